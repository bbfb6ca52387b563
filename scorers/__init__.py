"""Scoring plugins. Each returns a score in [0,1] per candidate; weights live in profiles.

The built-in table is explicit: a scorer is available by its type name only if it is listed here.
"""

from scorers.active_request import ActiveRequestScorer
from scorers.kv_cache_utilization import KVCacheUtilizationScorer
from scorers.prefix_cache import PrefixCacheScorer
from scorers.queue import QueueScorer

BUILTIN_SCORERS = (
    PrefixCacheScorer,
    QueueScorer,
    KVCacheUtilizationScorer,
    ActiveRequestScorer,
)

__all__ = [
    "BUILTIN_SCORERS",
    "ActiveRequestScorer",
    "KVCacheUtilizationScorer",
    "PrefixCacheScorer",
    "QueueScorer",
]
