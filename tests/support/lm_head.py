"""Watch the demo model's LM head: how many positions each of its calls
computed logits for (a prefill must compute the last one only)."""

from __future__ import annotations


def watch_lm_head(monkeypatch) -> list[int]:
    """From now on every model kvblock.demo.build_model builds records, per
    LM-head call, the number of positions it computed; the list returned."""
    from kvblock import demo

    rows: list[int] = []
    build = demo.build_model

    def build_and_watch():
        model = build()
        model.lm_head.register_forward_hook(lambda m, a, out: rows.append(out.shape[-2]))
        return model

    monkeypatch.setattr(demo, "build_model", build_and_watch)
    return rows
