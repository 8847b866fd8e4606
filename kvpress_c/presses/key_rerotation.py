from __future__ import annotations

from dataclasses import dataclass

from .base import ScorerPress, c_check, WrapperPress


@dataclass
class KeyRerotationPress(WrapperPress):
    """kvpress KeyRerotationPress (as in Hugging Face's SinkCache and FINCH, Corallo and Papotti, 2024):
    `press` chooses the kept tokens; their keys are then re-rotated to positions 0 .. n_kept - 1, so the
    compressed cache has no gaps in RoPE space. As in kvpress's pipeline, the tokens that follow the prefill
    (question, answer) continue from the compressed length; a Session driven by hand keeps the original
    positions unless it calls `session.set_position`. Session.cache_positions still reports the original
    positions of the kept tokens."""
    press: ScorerPress = None

    def __post_init__(self):
        if not isinstance(self.press, ScorerPress):
            raise ValueError("KeyRerotationPress wraps a scorer press, e.g. KeyRerotationPress(KnormPress(compression_ratio=0.5))")
        c_check(self.c_config())

    def c_config(self) -> dict:
        return self.press.c_config()

    def before_prefill(self, session, n: int, config: dict) -> None:
        session.set_press_array("key_rerotation", 1)
        self.press.before_prefill(session, n, config)

    def after_prefill(self, session, n: int, config: dict) -> None:
        # kvpress's pipeline: after a re-rotated cache, positions go on from its length (cache.get_seq_length())
        session.set_position(int(session.cache_lengths().max()))
