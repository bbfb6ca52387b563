"""Scoring plugins. Each returns a score in [0,1] per candidate; weights live in profiles.

The built-in table is explicit: a scorer is available by its type name only if it is listed here.
"""

from scorers.active_request import ActiveRequestScorer
from scorers.hardware_class import HardwareClassScorer
from scorers.kv_cache_utilization import KVCacheUtilizationScorer
from scorers.load_aware import LoadAwareScorer
from scorers.lora_affinity import LoraAffinityScorer
from scorers.predicted_latency import PredictedLatencyScorer
from scorers.prefix_cache import PrefixCacheScorer
from scorers.queue import QueueScorer
from scorers.session_affinity import SessionAffinityScorer

BUILTIN_SCORERS = (
    PrefixCacheScorer,
    QueueScorer,
    KVCacheUtilizationScorer,
    ActiveRequestScorer,
    LoadAwareScorer,
    HardwareClassScorer,
    PredictedLatencyScorer,
    LoraAffinityScorer,
    SessionAffinityScorer,
)

__all__ = [
    "BUILTIN_SCORERS",
    "ActiveRequestScorer",
    "HardwareClassScorer",
    "KVCacheUtilizationScorer",
    "LoadAwareScorer",
    "LoraAffinityScorer",
    "PredictedLatencyScorer",
    "PrefixCacheScorer",
    "QueueScorer",
    "SessionAffinityScorer",
]
