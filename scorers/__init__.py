"""Scoring plugins. Each returns a score in [0,1] per candidate; weights live in profiles.
(`context-length-aware` is a filter too: llm-d's plugin of that name is both.)

The built-in table is explicit: a scorer is available by its type name only if it is listed here.
"""

from kv_picker.scorers.active_request import ActiveRequestScorer
from kv_picker.scorers.context_length import ContextLengthAware
from kv_picker.scorers.hardware_class import HardwareClassScorer
from kv_picker.scorers.kv_cache_utilization import KVCacheUtilizationScorer
from kv_picker.scorers.load_aware import LoadAwareScorer
from kv_picker.scorers.lora_affinity import LoraAffinityScorer
from kv_picker.scorers.no_hit_lru import NoHitLruScorer
from kv_picker.scorers.precise_prefix_cache import PrecisePrefixCacheScorer
from kv_picker.scorers.predicted_latency import PredictedLatencyScorer
from kv_picker.scorers.prefix_affinity import PrefixCacheAffinityFilter
from kv_picker.scorers.prefix_cache import PrefixCacheScorer
from kv_picker.scorers.queue import QueueScorer, RunningRequestsScorer
from kv_picker.scorers.recent_work import RecentWorkScorer
from kv_picker.scorers.session_affinity import SessionAffinityScorer
from kv_picker.scorers.token_load import TokenLoadScorer

BUILTIN_SCORERS = (
    PrefixCacheScorer,
    PrecisePrefixCacheScorer,
    QueueScorer,
    KVCacheUtilizationScorer,
    ActiveRequestScorer,
    LoadAwareScorer,
    HardwareClassScorer,
    PredictedLatencyScorer,
    LoraAffinityScorer,
    SessionAffinityScorer,
    RecentWorkScorer,
    NoHitLruScorer,
    RunningRequestsScorer,
    ContextLengthAware,
    TokenLoadScorer,
)
# Filters that read the endpoints' state (the scheduling layer's own filters read labels only).
BUILTIN_STATE_FILTERS = (PrefixCacheAffinityFilter,)

__all__ = [
    "BUILTIN_SCORERS",
    "BUILTIN_STATE_FILTERS",
    "ActiveRequestScorer",
    "ContextLengthAware",
    "HardwareClassScorer",
    "KVCacheUtilizationScorer",
    "LoadAwareScorer",
    "LoraAffinityScorer",
    "NoHitLruScorer",
    "PrecisePrefixCacheScorer",
    "PredictedLatencyScorer",
    "PrefixCacheAffinityFilter",
    "PrefixCacheScorer",
    "QueueScorer",
    "RecentWorkScorer",
    "RunningRequestsScorer",
    "SessionAffinityScorer",
    "TokenLoadScorer",
]
