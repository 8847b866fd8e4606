"""Presses: kvpress names and arguments, computed in C. Each also accepts budget= (tokens kept per
KV head per layer, the papers' convention) instead of compression_ratio=."""
from .adakv import AdaKVPress
from .base import BasePress, ScorerPress
from .chunkkv import ChunkKVPress
from .entropy_gated_chunkkv import EntropyGatedChunkKVPress
from .edie import EDIEPress
from .judgeq import JudgeQPress, ResponseGuidedPress
from .knorm import KnormPress
from .observed_attention import ObservedAttentionPress
from .pyramidkv import PyramidKVPress
from .random import RandomPress
from .snapkv import SnapKVPress
from .streaming_llm import StreamingLLMPress
from .tada import TADAPress
from .take import TAKEPress
from .tova import TOVAPress
# kvpress's scorers
from .critical_adakv import CriticalAdaKVPress
from .criticalkv import CriticalKVPress
from .expected_attention import ExpectedAttentionPress
from .keydiff import KeyDiffPress
from .lagkv import LagKVPress
from .non_causal_attention import NonCausalAttnPress
from .kvzip import KVzipPress
from .kvgrad import KVgradPress
from .restorekv import RestoreKVPress
from .kvcompose import KVComposePress
from .leverage import LeverageScorePress
from .cur import CURPress
from .compactor import CompactorPress
from .finch import FinchPress
from .simlayerkv import SimLayerKVPress
from .cap import CapPress
from .dms import DMSPress
# compression while decoding
from .compression_ratio_decoding import CompressionRatioDecodingPress
from .decoding import DecodingPress
from .prefill_decoding import PrefillDecodingPress
from .cam import CAMPress
# value merging on eviction
from .merging import MergingPress
# wrappers
from .block import BlockPress
from .chunk import ChunkPress
from .composed import ComposedPress
from .key_rerotation import KeyRerotationPress
from .per_layer_compression import PerLayerCompressionPress
# key channels
from .think import ThinKPress
# presses whose files come from a model hub, read from a local path
from .duo_attention import DuoAttentionPress
from .kvzap import KVzapPress
from .qfilter import QFilterPress
from .expected_attention_stats import ExpectedAttentionStatsPress
from .lukv import LUKVPress
from .fastkvzip import FastKVzipPress

__all__ = ["BasePress", "ScorerPress", "SnapKVPress", "PyramidKVPress", "StreamingLLMPress", "KnormPress",
           "TOVAPress", "ObservedAttentionPress", "RandomPress", "AdaKVPress", "ChunkKVPress", "EntropyGatedChunkKVPress", "EDIEPress",
           "TADAPress", "TAKEPress", "JudgeQPress", "ResponseGuidedPress",
           "ExpectedAttentionPress", "KeyDiffPress", "LagKVPress", "CriticalKVPress", "CriticalAdaKVPress",
           "NonCausalAttnPress", "KVzipPress", "KVgradPress", "RestoreKVPress", "LeverageScorePress", "CURPress", "CompactorPress", "FinchPress", "SimLayerKVPress",
           "CapPress", "DMSPress", "KVComposePress",
           "DecodingPress", "PrefillDecodingPress", "CompressionRatioDecodingPress", "CAMPress", "MergingPress",
           "ComposedPress", "PerLayerCompressionPress", "KeyRerotationPress", "BlockPress", "ChunkPress", "ThinKPress",
           "DuoAttentionPress", "QFilterPress", "KVzapPress", "ExpectedAttentionStatsPress", "LUKVPress", "FastKVzipPress"]
