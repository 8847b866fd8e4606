from __future__ import annotations

from dataclasses import dataclass

from .. import _core
from .base import BasePress, ScorerPress, check_int
from .expected_attention import ExpectedAttentionPress


def base_config(press: BasePress) -> dict:
    """The scorer, allocation and chunks of a base press, without its budget (a decoding press sets it)."""
    from .adakv import AdaKVPress
    from .chunkkv import ChunkKVPress
    if not isinstance(press, (ScorerPress, AdaKVPress, ChunkKVPress)) or getattr(press, "beta", None) is not None \
            and not isinstance(press, ScorerPress):
        raise ValueError("a decoding press wraps a scorer press (SnapKVPress, TOVAPress, KnormPress, StreamingLLMPress, "
                         f"RandomPress), AdaKVPress or ChunkKVPress, got {press!r}")
    inner = getattr(press, "press", press)
    if type(inner).before_prefill is not BasePress.before_prefill and not hasattr(inner, "engine_stats"):
        # files set on a prefill session (filters, surrogate models); ExpectedAttentionStats's statistics do reach it
        raise ValueError(f"a decoding press scores with its base press's scorer alone: {type(inner).__name__} needs its "
                         "files on a prefill session; use it as a prefill press (PrefillDecodingPress's prefilling_press)")
    cfg = press.c_config()
    cfg.update(compression_ratio=0.0, budget=0)
    return cfg


@dataclass
class DecodingPress(BasePress):
    """Compression while decoding (kvpress DecodingPress): every `compression_interval` forward calls after
    the prefill (each generated token is one; a question of several tokens is one too), each layer is
    compressed to `target_size` tokens per KV head with `base_press`'s scores, right after its attention,
    and the evicted rows are freed for real (the ragged cache is re-packed with room for the next
    `compression_interval` tokens, so the cache stays under target_size + compression_interval rows).
    The prefill itself is not compressed (PrefillDecodingPress adds a prefill press).

    Window scorers (SnapKV) read the queries of the last window_size steps, which must be buffered:
    min(compression_interval, hidden_states_buffer_size + 1) > window_size. Differs from kvpress on one
    point: kvpress rotates every buffered query with the current token's RoPE angles (it reuses the step's
    position embeddings); here each keeps its own position, as in a prefill. TOVA, Knorm, StreamingLLM
    and Random do not depend on it. ExpectedAttention estimates the queries from every buffered row after
    its first n_sink (so min(compression_interval, hidden_states_buffer_size + 1) > n_sink), with kvpress's
    future positions (from the buffer's length); ExpectedAttentionStatsPress brings its statistics instead.
    """
    base_press: BasePress = None
    compression_interval: int = 512
    target_size: int = 2048
    hidden_states_buffer_size: int = 256

    def __post_init__(self):
        self.check_types()
        _core.decoding_config_check(**self.decoding_config())

    def check_types(self) -> None:
        base_config(self.base_press)
        check_int("compression_interval", self.compression_interval, minimum=1)
        check_int("target_size", self.target_size, minimum=1)
        check_int("hidden_states_buffer_size", self.hidden_states_buffer_size, minimum=0)
        inner = getattr(self.base_press, "press", self.base_press)
        rows = min(self.compression_interval, self.hidden_states_buffer_size + 1)
        reads_queries = isinstance(inner, ExpectedAttentionPress) and not hasattr(inner, "engine_stats")
        if reads_queries and rows <= inner.n_sink:
            # its statistics drop the buffer's first n_sink rows (kvpress would average nothing: NaN scores)
            raise ValueError(f"DecodingPress(ExpectedAttentionPress) estimates the queries from the buffered rows after "
                             f"the first n_sink={inner.n_sink}: min(compression_interval, hidden_states_buffer_size + 1) "
                             f"= {rows} must exceed n_sink (raise them, or lower n_sink)")

    @property
    def prefill_part(self):
        return None  # nothing happens during the prefill

    def c_config(self) -> dict:
        return {}

    def decoding_config(self) -> dict:
        return dict(base_config(self.base_press), compression_interval=self.compression_interval,
                    target_size=self.target_size, hidden_states_buffer_size=self.hidden_states_buffer_size)

    def before_decoding(self, session, config: dict) -> None:
        inner = getattr(self.base_press, "press", self.base_press)
        if hasattr(inner, "engine_stats"):  # ExpectedAttentionStatsPress: its statistics, not the buffered queries'
            session.set_decoding_query_stats(*inner.engine_stats(config))
