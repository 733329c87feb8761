"""The ``kvblock`` admin command."""
