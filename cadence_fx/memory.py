"""Memory as the device sees it: the three figures every benchmark record carries.

`torch.cuda.max_memory_allocated` (peak allocated) counts live tensors only. CUDA-graph pools keep
every captured class's intermediates reserved whether or not a tensor is alive in them, and the
caching allocator keeps freed blocks reserved too, so what a deployment can fit on a GPU is the
reserved memory and, below that, what the device itself reports used. `DeviceMemory` records all
three:

* ``peak_allocated_bytes``: `torch.cuda.max_memory_allocated` since the last `reset_peak`;
* ``reserved_bytes_end`` / ``reserved_bytes_max``: `torch.cuda.memory_reserved` at `record`, and
  its largest since the last `reset_peak` (`torch.cuda.max_memory_reserved`, never below a
  `sample`'s). The end can be below the peak allocated: memory freed and given back to the device
  in between (`torch.cuda.empty_cache`) is no longer reserved;
* ``device_footprint_bytes_end`` / ``device_footprint_bytes_max``: device memory in use
  (`torch.cuda.mem_get_info`: total - free) less what was in use when the `DeviceMemory` was
  started, which a benchmark does first thing in its process, after the CUDA context exists. The
  footprint therefore counts everything this process put on the device after its start (weights,
  pools, cuBLAS workspaces, allocator slack) and nothing that other processes held before; another
  process that allocates meanwhile would be counted too, so benchmarks run alone on their device.

Without CUDA every figure is None: nothing pretends to measure.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceMemory"]


def _used(device: torch.device) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class DeviceMemory:
    """The three memory figures of one benchmark process (module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.used_at_start: int | None = None
        self.reserved_max = 0
        self.footprint_max = 0
        if self.cuda:
            torch.cuda.init()
            torch.cuda.synchronize(self.device)
            self.used_at_start = _used(self.device)

    @classmethod
    def of_process(cls) -> DeviceMemory:
        """This process's figures on the current CUDA device; without CUDA, every figure is None."""
        return cls("cuda" if torch.cuda.is_available() else "cpu")

    def reset_peak(self) -> None:
        """Start a new measurement window: peak allocated and the sampled maxima from now on."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.reserved_max = self.footprint_max = 0

    def footprint(self) -> int | None:
        """Device bytes in use now beyond those in use at the start."""
        if self.used_at_start is None:  # set exactly when CUDA is measured
            return None
        return _used(self.device) - self.used_at_start

    def sample(self) -> None:
        """Fold the current reserved and device-used bytes into the maxima (call between steps)."""
        if self.used_at_start is not None:  # set exactly when CUDA is measured
            self.reserved_max = max(self.reserved_max, torch.cuda.memory_reserved(self.device))
            self.footprint_max = max(self.footprint_max, _used(self.device) - self.used_at_start)

    def record(self) -> dict[str, Any]:
        """The figures now, as a benchmark record's fields."""
        if not self.cuda:
            return {
                "peak_allocated_bytes": None,
                "reserved_bytes_end": None,
                "reserved_bytes_max": None,
                "device_footprint_bytes_end": None,
                "device_footprint_bytes_max": None,
                "device_used_at_start_bytes": None,
            }
        torch.cuda.synchronize(self.device)
        self.sample()
        return {
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(self.device),
            "reserved_bytes_end": torch.cuda.memory_reserved(self.device),
            "reserved_bytes_max": max(self.reserved_max, torch.cuda.max_memory_reserved(self.device)),
            "device_footprint_bytes_end": self.footprint(),
            "device_footprint_bytes_max": self.footprint_max,
            "device_used_at_start_bytes": self.used_at_start,
        }
