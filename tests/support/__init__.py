"""Test tools shared by the suites (loop devices, fault injection); tested in tests/support/."""
