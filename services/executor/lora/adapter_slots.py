"""The LoRA adapters an executor holds, and each step's share of them.

Two tiers, as vLLM keeps them: every adapter this executor was asked to prepare (the scheduler
does so when it admits a request for it; the api when it loads one) is *known*: parsed, checked
against the base, on the host. At most `max_adapters` of them sit in *slots*, the table the
step's deltas read; a step names each token's slot. A step needing an adapter outside the slots
takes a free slot or the least recently used one that this step does not use, so a step may mix
up to `max_adapters` adapters (the scheduler keeps it so: planner.py's
`_adapter_fits_first`).

An adapter the api unloads is forgotten once no request this executor holds still runs on it:
requests already streaming finish on it.

Pure: no bus. The service prepares adapters between steps on the forward thread, so the slot
table never changes under a running step.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field

import torch

from llmbus.services.executor.lora.kernel_tables import KERNEL_TARGETS, LoraMatrix, LoraStep
from llmbus.services.executor.weights.lora_files import LoraWeights, check_fits
from llmbus.services.executor.weights.model_config import LlamaConfig

Matrices = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> a, bt


@dataclass
class StepAdapters:
    """One forward's adapters: each token's slot (-1: the base alone) over the slots' matrices.
    Backends add the deltas after each projection: the integer kernel from `kernel`, the torch
    backend through `add`."""

    token_slot: torch.Tensor  # [T] int32
    slots: AdapterSlots
    kernel: LoraStep
    grouped: tuple[torch.Tensor, ...] = ()  # what `kernel` points into: kept alive with it
    _rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # `add`'s, per slot

    @property
    def kernel_pointer(self) -> int:
        return ctypes.addressof(self.kernel)

    def add(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor,
            column: int = 0) -> None:
        """y[:, column:column + n] += the delta of `target` in `layer` on x [T, k], for each
        token with an adapter that changes it (one matmul pair per slot in the step)."""
        if not self._rows:  # each slot's rows, found once a forward (not once a projection)
            self._rows = [(slot, (self.token_slot == slot).nonzero().squeeze(1).to(x.device))
                          for slot in self.token_slot.unique().tolist() if slot >= 0]
        for slot, rows in self._rows:
            pair = self.slots.matrices[slot].get((layer, target))
            if pair is None:
                continue
            a, bt = pair
            delta = (x.index_select(0, rows).float() @ a.T) @ bt  # [rows, n]
            y[:, column:column + bt.shape[1]].index_add_(0, rows, delta.to(y.dtype))


class AdapterSlots:
    def __init__(self, config: LlamaConfig, max_adapters: int, max_rank: int,
                 device: torch.device | str = "cpu") -> None:
        """`device`: the model's (the torch backend's deltas are computed there)."""
        if max_adapters < 1:
            raise ValueError("--max-loras must be at least 1 where adapters are enabled")
        self.config, self.max_adapters, self.max_rank = config, max_adapters, max_rank
        self.device = torch.device(device)
        self.known: dict[str, LoraWeights] = {}
        self.names: list[str | None] = [None] * max_adapters  # by slot
        self.matrices: list[Matrices] = [{} for _ in range(max_adapters)]
        self._halves: list[list[torch.Tensor]] = [[] for _ in range(max_adapters)]  # kernel's
        self._per_slot = config.num_layers * len(KERNEL_TARGETS)
        self.table = (LoraMatrix * (max_adapters * self._per_slot))()
        self._clock = itertools.count(1)
        self._last_used = [0] * max_adapters
        self._unloaded: set[str] = set()

    def prepare(self, name: str, weights: LoraWeights) -> str:
        """Know `name` from now on; "" or why it does not fit the base (one line)."""
        problem = check_fits(weights, self.config, self.max_rank)
        if problem:
            return problem
        self.known[name] = weights
        self._unloaded.discard(name)
        return ""

    def holds(self, name: str) -> bool:
        """Prepared and not unloaded since (a name loaded again after an unload is fetched
        again: it may be another adapter)."""
        return name in self.known and name not in self._unloaded

    def forget(self, name: str) -> None:
        """The api unloaded `name`: drop it once no live request runs on it (`collect`)."""
        if name in self.known:
            self._unloaded.add(name)

    @property
    def unloading(self) -> bool:
        """Adapters unloaded that a live request may still run on (`collect` has work)."""
        return bool(self._unloaded)

    def collect(self, live: set[str]) -> None:
        """Drop unloaded adapters that no request in `live` (the executor's) runs on."""
        for name in self._unloaded - live:
            self.known.pop(name, None)
            if name in self.names:
                self._clear(self.names.index(name))
        self._unloaded &= live

    def resident(self) -> list[str]:
        return [n for n in self.names if n is not None]

    def step(self, adapters: list[str], query_lens: list[int]) -> StepAdapters | None:
        """The forward's adapters for sequences running `adapters` ("": the base) with these
        query lengths; None where all run the base. KeyError for an adapter never prepared,
        RuntimeError for more adapters than slots."""
        wanted = {a for a in adapters if a}
        if not wanted:
            return None
        slot_of = {name: self._place(name, wanted) for name in sorted(wanted)}
        now = next(self._clock)
        for slot in slot_of.values():
            self._last_used[slot] = now
        per_sequence = torch.tensor([slot_of.get(a, -1) for a in adapters], dtype=torch.int32)
        token_slot = per_sequence.repeat_interleave(torch.tensor(query_lens))
        order = torch.argsort(token_slot, stable=True)  # grouped by slot, base tokens first
        counts = torch.bincount(token_slot + 1, minlength=self.max_adapters + 1)
        offsets = torch.cumsum(counts, 0)  # slot s's tokens end at offsets[s + 1]
        kernel = LoraStep(order.data_ptr(), offsets.data_ptr(), ctypes.addressof(self.table),
                          self.config.num_layers, self.max_adapters, token_slot.numel())
        return StepAdapters(token_slot, self, kernel, (order, offsets))

    def _place(self, name: str, keep: set[str]) -> int:
        """The slot holding `name`, loading it into a free or the least recently used slot
        outside `keep` where none does."""
        if name in self.names:
            return self.names.index(name)
        if name not in self.known:
            raise KeyError(f"adapter {name!r} was never prepared on this executor")
        free = [s for s, n in enumerate(self.names) if n is None or n not in keep]
        if not free:
            raise RuntimeError(f"a step mixes more adapters than the {self.max_adapters} "
                               "slots (--max-loras)")
        slot = min(free, key=lambda s: (self.names[s] is not None, self._last_used[s]))
        self._clear(slot)
        self._fill(slot, name, self.known[name])
        return slot

    def _fill(self, slot: int, name: str, weights: LoraWeights) -> None:
        """The slot's matrices: float32 for the torch backend, bfloat16 for the integer kernel
        (lora_delta.cpp says why)."""
        targets = {t: i for i, t in enumerate(KERNEL_TARGETS)}
        matrices: Matrices = {}
        halves: list[torch.Tensor] = []
        for (layer, target), (a, b) in weights.matrices.items():
            a = a.float().contiguous()
            bt = (b.float() * weights.scaling).T.contiguous()  # [rank, n], scaled once
            matrices[layer, target] = (a.to(self.device), bt.to(self.device))
            if self.device.type != "cpu":
                continue  # the integer kernel's are the CPU's only
            a16, bt16 = a.bfloat16(), bt.bfloat16()
            halves += [a16, bt16]
            entry = self.table[slot * self._per_slot + layer * len(targets) + targets[target]]
            entry.a, entry.bt = a16.data_ptr(), bt16.data_ptr()
            entry.rank, entry.k, entry.n = a.shape[0], a.shape[1], bt.shape[1]
        self.names[slot], self.matrices[slot] = name, matrices  # keeps the tensors alive
        self._halves[slot] = halves

    def _clear(self, slot: int) -> None:
        for i in range(slot * self._per_slot, (slot + 1) * self._per_slot):
            self.table[i] = LoraMatrix()
        self.names[slot], self.matrices[slot], self._halves[slot] = None, {}, []
