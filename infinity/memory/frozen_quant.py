"""Frozen weights kept quantized at their home (``offload.frozen_weights``, QLoRA-style).

A *quantized group* is a frozen group (no trainable slot, :mod:`infinity.runtime.groups`)
holding at least one quantizable weight: the ``weight`` of an ``nn.Linear``, of GPT-2's
``Conv1D`` or of an ``nn.Embedding`` whose ``requires_grad`` is False.  Its home (host
buffer or NVMe extent) does not hold the flat working-precision values but a *payload*:
one byte blob laid out by a :class:`QuantLayout`, one :class:`PackedSlot` per slot of the
group (one record per managed tensor; nothing is attached to ``nn.Parameter``):

* a quantizable slot: the tensors of :meth:`~infinity.quant.QuantizedWeight.tensors`
  (payload codes, block scales or double-quantized scales) at 64-byte aligned offsets;
* any other slot (a frozen bias or norm of the same module): its values in the working
  precision, unchanged.

The blob is padded to a multiple of 4096 bytes (one aligned I/O).  Its size is known from
the shapes alone (:func:`layout_for`), so the placement plan and the NVMe reservation
count the quantized bytes before anything is quantized; :meth:`QuantLayout.pack`
quantizes once at ``initialize`` and checks the sizes it predicted.

Note [Quantized homes]
~~~~~~~~~~~~~~~~~~~~~~
A quantized group's compute buffer (``GroupRecord.device_buf``, ``padded_numel`` elements
of the working dtype, what the parameters view) is never its home: every fetch leases
one, and :meth:`QuantLayout.unpack` fills it from the payload just before use
(``MemoryManager`` in infinity/memory/manager.py: ``Fetch.qsrc``).  The payload is never
written back (frozen) and no optimizer sees the group (no trainable slot).  So every code
that reads a group's home directly must go through this layout when ``g.quant`` is set:
``GroupRecord.home_nbytes`` (the home's size: host lease, NVMe extent, plan, staging),
``slot_values`` (weights out, checkpoints).  The padding of the compute buffer between
slots is not written (frozen groups are never stepped, nothing reads it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinity.quant import QuantizationError, QuantizedWeight, quantize_weight
from infinity.quant.nf4 import DQ_BLOCK, double_dequantize, packed_nbytes

__all__ = ["QuantSpec", "PackedSlot", "QuantLayout", "RangeRead", "layout_for",
           "quantizable_weights", "QUANTIZABLE", "is_conv1d", "read_payload", "home_values",
           "write_home_values", "slot_value"]

_ALIGN = 64            # each stored tensor starts at a multiple of this many bytes
_HOME_ALIGN = 4096     # the payload is one aligned I/O

#: Module kinds whose frozen ``weight`` is stored quantized (GPT-2's Conv1D by its class
#: name and module: transformers is not imported).
QUANTIZABLE = ("torch.nn.Linear", "torch.nn.Embedding", "transformers Conv1D")


def _round(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class QuantSpec:
    """``offload.frozen_weights``: the storage format of frozen weights."""
    dtype: str                 # "nf4" | "int8" | "int4"
    group_size: int = 64
    double_quant: bool = False


def is_conv1d(mod) -> bool:
    """GPT-2's ``Conv1D`` (transformers), known by its class name and module (transformers
    is not imported)."""
    t = type(mod)
    return t.__name__ == "Conv1D" and t.__module__.startswith("transformers")


def quantizable_weights(model: torch.nn.Module) -> set[int]:
    """``id`` of every frozen ``weight`` of an ``nn.Linear``, ``Conv1D`` or ``nn.Embedding``
    in ``model`` (tied weights once)."""
    out = set()
    for mod in model.modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) or is_conv1d(mod):
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.nn.Parameter) and not w.requires_grad \
                    and w.is_floating_point():
                out.add(id(w))
    return out


def _tensor_sizes(numel: int, spec: QuantSpec) -> list[tuple[str, torch.dtype, int]]:
    """(name, dtype, elements) of what :func:`quantize_weight` stores for ``numel``
    elements, in :meth:`QuantizedWeight.tensors` order."""
    nblocks = -(-numel // spec.group_size)
    if spec.dtype == "nf4":
        data = ("data", torch.uint8, packed_nbytes(numel))
    elif spec.dtype == "int8":
        data = ("data", torch.int8, numel)
    else:
        data = ("data", torch.int32, -(-numel // 8))
    if not spec.double_quant:
        return [data, ("scales", torch.float32, nblocks)]
    return [data, ("qscales", torch.uint8, nblocks),
            ("scales2", torch.float32, -(-nblocks // DQ_BLOCK)), ("offset", torch.float32, 1)]


@dataclass
class PackedSlot:
    """Where one slot of a quantized group lives in the payload: ``tensors`` maps a stored
    tensor's name to ``(byte offset, dtype, elements)``; ``quantized`` False: one tensor
    ``"raw"`` in the working dtype."""
    index: int                       # the slot's index in ``GroupRecord.slots``
    quantized: bool
    tensors: dict


class RangeRead:
    """What a tile of a quantized group reads (Note [Quantized tiles]): byte ``spans`` of
    the payload (``(name, lo, hi)``, one per stored tensor of the slot, in order) that
    decode alone into elements ``first .. first + count`` of the group's flat values (a
    whole number of blocks around the range asked for)."""
    __slots__ = ("spans", "first", "count", "_decode")

    def __init__(self, spans, first: int, count: int, decode):
        self.spans, self.first, self.count, self._decode = spans, first, count, decode

    @property
    def nbytes(self) -> int:
        """Payload bytes the range needs (before any alignment of a read)."""
        return sum(b - a for _, a, b in self.spans)

    def decode(self, views: dict, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (``count`` elements of the working dtype, contiguous) from
        ``views`` (span name -> uint8 tensor holding exactly that span's bytes, on the
        device ``out`` is on)."""
        self._decode(views, out)
        return out


class QuantLayout:
    """The payload of one quantized group (Note [Quantized homes])."""

    def __init__(self, spec: QuantSpec, slots: list[PackedSlot], nbytes: int,
                 compute_dtype: torch.dtype):
        self.spec = spec
        self.slots = slots
        self.nbytes = nbytes                 # payload bytes, padded to 4096
        self.compute_dtype = compute_dtype

    @property
    def quantized_slots(self) -> int:
        return sum(1 for p in self.slots if p.quantized)

    def _views(self, blob: torch.Tensor, ps: PackedSlot) -> dict[str, torch.Tensor]:
        return {k: blob[off:off + n * dt.itemsize].view(dt)
                for k, (off, dt, n) in ps.tensors.items()}

    def _qweight(self, blob: torch.Tensor, ps: PackedSlot, slot) -> QuantizedWeight:
        v = self._views(blob, ps)
        if "offset" in v:
            v["offset"] = v["offset"].view(())
        return QuantizedWeight(dtype=self.spec.dtype, shape=torch.Size(slot.shape),
                               group_size=self.spec.group_size, data=v["data"],
                               scales=v.get("scales"), qscales=v.get("qscales"),
                               scales2=v.get("scales2"), offset=v.get("offset"),
                               orig_dtype=self.compute_dtype, name=slot.name)

    def pack(self, g, blob: torch.Tensor, values: torch.Tensor | None = None) -> None:
        """Quantize ``g``'s parameters (their current values; or the flat group ``values``
        in the working dtype, a checkpoint load) into ``blob`` (uint8, ``nbytes``): once at
        ``initialize``."""
        blob.zero_()
        with torch.no_grad():
            for ps in self.slots:
                s = g.slots[ps.index]
                # the working dtype on both paths: a load that quantizes the same values
                # again (a base named by its files) gives the same bytes
                src = s.param.detach().to(self.compute_dtype) if values is None else \
                    values[s.offset:s.offset + s.numel].view(s.shape)
                if not ps.quantized:
                    (off, dt, n), = ps.tensors.values()
                    blob[off:off + n * dt.itemsize].view(dt).copy_(src.reshape(-1))
                    continue
                qw = quantize_weight(src, self.spec.dtype, self.spec.group_size,
                                     double_quant=self.spec.double_quant, name=s.name)
                for k, t in qw.tensors().items():
                    off, dt, n = ps.tensors[k]
                    if t.dtype != dt or t.numel() != n:     # an internal invariant
                        raise QuantizationError(
                            f"frozen_weights: {s.name}.{k} has {t.numel()} x {t.dtype}, the "
                            f"layout expected {n} x {dt}")
                    blob[off:off + n * dt.itemsize].view(dt).copy_(t.reshape(-1))

    def unpack(self, blob: torch.Tensor, out: torch.Tensor, g) -> None:
        """Fill ``out`` (``g``'s flat compute buffer, working dtype) from the payload
        ``blob`` (uint8, on the same device)."""
        with torch.no_grad():
            for ps in self.slots:
                s = g.slots[ps.index]
                dst = out[s.offset:s.offset + s.numel]
                if ps.quantized:
                    self._qweight(blob, ps, s).dequantize(out=dst)
                else:
                    dst.copy_(self._views(blob, ps)["raw"])

    def slot_values(self, blob: torch.Tensor, g, index: int) -> torch.Tensor:
        """Slot ``index``'s values (working dtype, flat) from the payload ``blob``."""
        s = g.slots[index]
        for ps in self.slots:
            if ps.index == index:
                if not ps.quantized:
                    return self._views(blob, ps)["raw"].clone()
                out = torch.empty(s.numel, dtype=self.compute_dtype, device=blob.device)
                return self._qweight(blob, ps, s).dequantize(out=out)
        raise KeyError(index)

    def slot_range(self, index: int) -> tuple[int, int]:
        """The byte range of slot ``index`` in the payload (to read it alone from NVMe)."""
        for ps in self.slots:
            if ps.index == index:
                spans = [(off, off + n * dt.itemsize) for off, dt, n in ps.tensors.values()]
                return min(a for a, _ in spans), max(b for _, b in spans)
        raise KeyError(index)

    def rebase(self, ps_index: int, lo: int) -> "QuantLayout":
        """The layout of slot ``ps_index`` alone, its offsets relative to byte ``lo``."""
        ps = next(p for p in self.slots if p.index == ps_index)
        moved = {k: (off - lo, dt, n) for k, (off, dt, n) in ps.tensors.items()}
        return QuantLayout(self.spec, [PackedSlot(ps.index, ps.quantized, moved)], 0,
                           self.compute_dtype)

    # Note [Quantized tiles]
    # ~~~~~~~~~~~~~~~~~~~~~~
    # Memory-centric tiling (infinity/runtime/tiling.py) reads element ranges of a group,
    # never the whole group.  Blocks are quantized independently, so a range of a quantized
    # slot decodes alone from the bytes of its blocks: their payload codes and their scales
    # -- under double quantization their 8-bit scale codes (those of whole 256-block runs,
    # a few hundred bytes more), the second-level scales of those runs and the offset,
    # decoded to the blocks' fp32 scales first.  The range is widened to the *unit* that
    # makes the codes a whole slice: ``group_size`` elements, a multiple of 8 for int4
    # (eight codes per int32 word).  The tile reads those spans (from NVMe each 4 KiB-
    # aligned, neighbours in one read), decodes them into a working-precision lease and
    # hands out the rows it asked for; nothing else of the payload moves, so a tile of a
    # 4-bit base reads about a quarter of the bytes (plus a page at each end of a span:
    # small next to tiles of megabytes).
    def unit(self) -> int:
        """Elements a tile of a quantized slot is widened to a multiple of."""
        gs = self.spec.group_size
        return math.lcm(gs, 8) if self.spec.dtype == "int4" else gs

    def range_read(self, g, lo: int, hi: int) -> RangeRead:
        """The spans of the payload that hold elements ``lo .. hi`` of ``g``'s flat values
        (one slot's; Note [Quantized tiles])."""
        for ps in self.slots:
            s = g.slots[ps.index]
            if s.offset <= lo and hi <= s.offset + s.numel:
                break
        else:
            raise ValueError(f"frozen_weights: elements {lo}..{hi} of group {g.gid} "
                             f"({g.name}) are not within one slot")
        e0, e1 = lo - s.offset, hi - s.offset
        if not ps.quantized:
            (off, dt, _n), = ps.tensors.values()
            isz = dt.itemsize

            def raw(views, out, dt=dt):
                out.copy_(views["raw"].view(dt))
            return RangeRead([("raw", off + e0 * isz, off + e1 * isz)], lo, hi - lo, raw)
        u, gs = self.unit(), self.spec.group_size
        E0, E1 = e0 // u * u, min(-(-e1 // u) * u, s.numel)
        b0, b1 = E0 // gs, -(-E1 // gs)
        r0, r1 = b0 // DQ_BLOCK, -(-b1 // DQ_BLOCK)         # runs of double-quantized scales
        nblocks = -(-s.numel // gs)
        dtype = self.spec.dtype
        ranges = {"data": {"nf4": (E0 // 2, -(-E1 // 2)), "int8": (E0, E1),
                           "int4": (E0 // 8 * 4, -(-E1 // 8) * 4)}[dtype],
                  "scales": (4 * b0, 4 * b1),
                  "qscales": (r0 * DQ_BLOCK, min(r1 * DQ_BLOCK, nblocks)),
                  "scales2": (4 * r0, 4 * r1), "offset": (0, 4)}
        spans = [(k, off + ranges[k][0], off + ranges[k][1])
                 for k, (off, _dt, _n) in ps.tensors.items()]
        spec, cdt, name = self.spec, self.compute_dtype, s.name

        def blocks(views, out):
            if "qscales" in views:
                sc = double_dequantize(views["qscales"], views["scales2"].view(torch.float32),
                                       views["offset"].view(torch.float32).view(()))
                sc = sc[b0 - r0 * DQ_BLOCK:b1 - r0 * DQ_BLOCK]
            else:
                sc = views["scales"].view(torch.float32)
            data = views["data"].view({"nf4": torch.uint8, "int8": torch.int8,
                                       "int4": torch.int32}[dtype])
            QuantizedWeight(dtype=spec.dtype, shape=torch.Size((E1 - E0,)),
                            group_size=spec.group_size, data=data, scales=sc,
                            orig_dtype=cdt, name=name).dequantize(out=out)
        return RangeRead(spans, s.offset + E0, E1 - E0, blocks)

    def tile_overhead_bytes(self, elements: int, itemsize: int) -> int:
        """Bytes a tile of ``elements`` elements takes beyond its working-precision rows:
        the widening to whole units (decoded) and its payload spans as read (aligned)."""
        u, gs = self.unit(), self.spec.group_size
        per = {"nf4": 0.5, "int8": 1.0, "int4": 0.5}[self.spec.dtype]
        n = elements + 2 * u
        scales = (2 * DQ_BLOCK + n // gs + 8) if self.spec.double_quant else 4 * (n // gs + 2)
        return 2 * u * itemsize + int(n * per) + scales + 4 * 2 * _HOME_ALIGN


def read_payload(g, swap, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, int]:
    """Bytes ``lo .. hi`` of quantized ``g``'s payload from its home (host buffer, or an
    aligned read of its NVMe extent) as ``(uint8 tensor, start)``: the tensor holds the
    payload from byte ``start`` (<= ``lo``, 4096-aligned for NVMe) on."""
    hi = g.quant.nbytes if hi is None else hi
    if g.host_buf is not None:            # a host home, or a device home's payload
        return (g.host_buf.cpu() if g.host_buf.device.type != "cpu" else g.host_buf), 0
    if g.home != "nvme" or swap is None:
        raise RuntimeError(f"frozen_weights: group {g.gid} ({g.name}) has no readable home")
    from infinity.io import aligned_empty
    a0 = lo // _HOME_ALIGN * _HOME_ALIGN
    a1 = min(_round(hi, _HOME_ALIGN), g.quant.nbytes)
    buf = aligned_empty(a1 - a0, torch.uint8)
    swap.read(g.extent, buf, a0).wait()
    return buf, a0


def home_values(g, swap) -> torch.Tensor:
    """Quantized ``g``'s flat values (working dtype, ``padded_numel``; padding zero),
    dequantized from its home: what its parameters compute with."""
    blob, _ = read_payload(g, swap)
    out = torch.zeros(g.padded_numel, dtype=g.dtype)
    g.quant.unpack(blob, out, g)
    return out


def write_home_values(g, swap, values: torch.Tensor, current: torch.Tensor | None = None
                      ) -> None:
    """Quantize the flat working-dtype ``values`` into ``g``'s home (a checkpoint load).
    Values equal to what the home already dequantizes to (``current``, read when not
    given) -- the same base saved and loaded -- leave the payload as it is (quantizing
    dequantized values again is not always the identity: double-quantized scales move)."""
    if current is None:
        current = home_values(g, swap)
    if torch.equal(values[:g.padded_numel], current):
        return
    if g.host_buf is not None and g.host_buf.device.type == "cpu":
        g.quant.pack(g, g.host_buf, values)
        return
    if g.host_buf is not None:            # a device home on separate memory
        buf = torch.empty(g.quant.nbytes, dtype=torch.uint8)
        g.quant.pack(g, buf, values)
        g.host_buf.copy_(buf)
        return
    from infinity.io import aligned_empty
    buf = aligned_empty(g.quant.nbytes, torch.uint8)
    g.quant.pack(g, buf, values)
    swap.write(g.extent, buf).wait()


def slot_value(g, swap, slot) -> torch.Tensor:
    """One slot's values (working dtype, flat) read from quantized ``g``'s home: only its
    bytes of the payload."""
    i = next(k for k, x in enumerate(g.slots) if x is slot)
    lo, hi = g.quant.slot_range(i)
    blob, start = read_payload(g, swap, lo, hi)
    if start == 0:
        return g.quant.slot_values(blob, g, i)
    return g.quant.rebase(i, start).slot_values(blob, g, i)


def layout_for(g, spec: QuantSpec, quantizable: set[int]) -> QuantLayout | None:
    """The payload layout of group ``g`` (working dtype ``g.dtype``), or None when ``g`` is
    trainable or holds no quantizable weight (it keeps the working precision)."""
    if g.trainable or not any(id(s.param) in quantizable for s in g.slots):
        return None
    end = 0
    slots = []
    for i, s in enumerate(g.slots):
        q = id(s.param) in quantizable
        sizes = _tensor_sizes(s.numel, spec) if q else [("raw", g.dtype, s.numel)]
        tensors = {}
        for name, dt, n in sizes:
            off = _round(end, _ALIGN)
            tensors[name] = (off, dt, n)
            end = off + n * dt.itemsize
        slots.append(PackedSlot(i, q, tensors))
    return QuantLayout(spec, slots, _round(max(end, 1), _HOME_ALIGN), g.dtype)
