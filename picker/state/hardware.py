"""Hardware classes: how fast an endpoint prefills and decodes, and how much KV it holds.

Each class is given relative to one H100 SXM (80 GB): prefill is compute-bound, so its speed
follows dense BF16 tensor throughput; decode is memory-bandwidth-bound, so its speed follows HBM
bandwidth; KV capacity follows memory size. The picker's scorers and the simulated endpoints
read the same table, so a policy measured on the simulator sees the hardware it will route to.

Sources (vendor datasheets; dense BF16 without sparsity):

| class | BF16 TFLOPS | memory BW TB/s | memory GB | source |
|---|---:|---:|---:|---|
| H100 (SXM5) | 989 | 3.35 | 80 | NVIDIA H100 Tensor Core GPU datasheet |
| H200 (SXM) | 989 | 4.8 | 141 | NVIDIA H200 Tensor Core GPU datasheet |
| A100 (SXM4 80GB) | 312 | 2.04 | 80 | NVIDIA A100 Tensor Core GPU datasheet |
| L40S | 362 | 0.864 | 48 | NVIDIA L40S datasheet |
| L4 | 121 | 0.300 | 24 | NVIDIA L4 Tensor Core GPU datasheet |

MIG slices of an H100 80GB (NVIDIA MIG user guide): a ``Ng.Mgb`` instance has N of the GPU's
7 compute slices and M/80 of its memory (memory slices of 10 GB, each with 1/8 of the memory
bandwidth), so ``1g.10gb`` prefills at 1/7 and decodes at 1/8 of the whole GPU.

Endpoints name their class with the label ``kv-picker.io/hardware-class``; the config's
``hardwareClasses:`` section adds classes or overrides these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

HARDWARE_CLASS_LABEL = "kv-picker.io/hardware-class"
DEFAULT_CLASS = "H100"

_H100_TFLOPS = 989.0
_H100_BANDWIDTH_TBS = 3.35
_H100_MEMORY_GB = 80.0


@dataclass(frozen=True, slots=True)
class HardwareClass:
    """Relative capability of one class of accelerator (1.0 = one H100 SXM 80 GB).

    Attributes:
        name: class name as used in labels and config.
        prefill_speed: relative prefill throughput (compute-bound), > 0.
        decode_speed: relative decode throughput (memory-bandwidth-bound), > 0.
        kv_capacity: relative KV-cache memory, > 0.
    """

    name: str
    prefill_speed: float
    decode_speed: float
    kv_capacity: float

    def validate(self) -> None:
        for field_name in ("prefill_speed", "decode_speed", "kv_capacity"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"{self.name}: {field_name} must be > 0")


def _gpu(name: str, tflops: float, bandwidth_tbs: float, memory_gb: float) -> HardwareClass:
    return HardwareClass(
        name,
        round(tflops / _H100_TFLOPS, 3),
        round(bandwidth_tbs / _H100_BANDWIDTH_TBS, 3),
        round(memory_gb / _H100_MEMORY_GB, 3),
    )


def _mig(compute_slices: int, memory_gb: int) -> HardwareClass:
    fraction = memory_gb / _H100_MEMORY_GB
    return HardwareClass(
        f"H100-MIG-{compute_slices}g.{memory_gb}gb",
        round(compute_slices / 7, 3),
        round(fraction, 3),
        round(fraction, 3),
    )


_MIG_PROFILES = ((1, 10), (2, 20), (3, 40), (4, 40), (7, 80))
_CLASSES = (
    _gpu("H100", 989, 3.35, 80),
    _gpu("H200", 989, 4.8, 141),
    _gpu("A100", 312, 2.04, 80),
    _gpu("L40S", 362, 0.864, 48),
    _gpu("L4", 121, 0.300, 24),
    *(_mig(compute, memory) for compute, memory in _MIG_PROFILES),
)
BUILTIN_HARDWARE_CLASSES: Mapping[str, HardwareClass] = {
    **{c.name: c for c in _CLASSES},
    # Short aliases, as MIG profiles appear in node labels (nvidia.com/mig-1g.10gb).
    **{f"{c}g.{m}gb": _mig(c, m) for c, m in _MIG_PROFILES},
}


class HardwareTable:
    """Class lookup with the config's additions, and each endpoint's class by label."""

    def __init__(
        self,
        overrides: Mapping[str, HardwareClass] | None = None,
        default_class: str = DEFAULT_CLASS,
    ) -> None:
        self.classes: dict[str, HardwareClass] = {**BUILTIN_HARDWARE_CLASSES, **(overrides or {})}
        if default_class not in self.classes:
            raise ValueError(f"default hardware class {default_class!r} is not in the table")
        self.default = self.classes[default_class]

    def of(self, labels: Mapping[str, str]) -> HardwareClass:
        """The class an endpoint's labels name; the default class when unlabelled or unknown."""
        name = labels.get(HARDWARE_CLASS_LABEL)
        if name is None:
            return self.default
        return self.classes.get(name, self.default)
