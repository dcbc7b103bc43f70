"""ZeRO stage 3 with a frozen base kept quantized (``offload.frozen_weights``): each rank
homes a byte shard of every quantized group's payload, and a fetch all-gathers the
quantized bytes, not the working precision.

Note [Quantized shards]
~~~~~~~~~~~~~~~~~~~~~~~
A quantized group's payload (``QuantLayout``, Note [Quantized homes] in
infinity/memory/frozen_quant.py) is one byte blob of ``quant.nbytes`` bytes.  At stage 3 it
is split by bytes, not by elements: rank ``r`` homes bytes ``[r * S, (r + 1) * S)`` of the
blob padded to ``world_size * S`` (``S`` a multiple of 4096, one aligned NVMe extent per
rank) -- host memory, its NVMe extent, or device memory.  ``place`` packs the whole blob on
every rank (the parameters are whole there before ``initialize`` returns; the same
quantizer gives every rank the same bytes) and keeps its shard.

A fetch leases the compute buffer (working precision, as any group) and a device-tier
buffer of ``world_size * S`` bytes; the gather worker brings this rank's shard into its
slot of that buffer (NVMe read, host copy / H2D, or the resident shard as the input) and
all-gathers the other shards into it on the ``param`` group, in the worker's order like
every parameter gather; ``wait_resident`` dequantizes the gathered blob into the compute
buffer and gives the blob back.  So the wire carries the quantized form -- about a quarter
of a bf16 base's bytes at 4 bits -- and each rank dequantizes after the gather; ZeRO++'s
qwZ (which would quantize again) is not applied to these groups (their bytes go
the ``param`` group's way: NCCL/gloo, or the shared-memory transport between the ranks of
one machine, as for any all-gather).  With hpZ (``zero_pp.hpz_partition_size`` H) the
gathered blob's ``1/H`` slice is kept as this rank's secondary shard, like any group's, and
the next gather of the group before the homes could change (the backward) all-gathers the
quantized bytes within the H ranks from it, without reading the home.

What reads a quantized group's values off the fetch path is collective: the values of a
group are the dequantized gathered blob (:func:`gathered_values`), so ``state_dict``,
gathered exports and checkpoints gather them on every rank in the same order, and a
checkpoint load gathers the loaded working-precision values and quantizes them again on
every rank (:func:`write_gathered_values`), each keeping its shard.

Memory-centric tiling of a quantized group across ranks (Note [Tiles across ranks] in
infinity/zero/partitioned_memory.py, Note [Quantized tiles] in
infinity/memory/frozen_quant.py): a tile's element range needs the payload byte spans
``QuantLayout.range_read`` names, each cut at the byte shards' boundaries.  Every rank
leases one device-tier buffer holding the spans side by side (each at a 64-byte aligned
offset, so the scale bytes view as fp32) and the tile's working-precision lease.  The
gather worker copies this rank's pieces in from its home and broadcasts every piece from
its owner, in order.  The main thread then decodes the spans into the tile.  The wire and
the homes carry only those spans: about a quarter of a bf16 tile's bytes at 4 bits.
"""
from __future__ import annotations

import time

import torch

from infinity.memory.manager import Fetch
from infinity.memory.record import GroupRecord

__all__ = ["PendingGather", "qshard_bytes", "QuantizedShards", "home_shard",
           "gathered_values", "write_gathered_values"]

_ALIGN = 4096


class PendingGather:
    """The fetch worker's job for one group: the ``handle`` of the manager's ``Fetch``
    (``done()``/``wait()`` like an NVMe read handle).  ``staging``: pinned host staging
    of an NVMe shard on separate device memory (given back once the job is done);
    ``marker``: after ``wait()``, the device-side completion compute waits on."""
    __slots__ = ("fut", "staging", "marker")

    def __init__(self, fut, staging=None):
        self.fut = fut
        self.staging = staging
        self.marker = None

    def done(self) -> bool:
        return self.fut.done()

    def wait(self) -> None:
        self.marker = self.fut.result()     # re-raises the worker's AioError / CollectiveError


def qshard_bytes(g: GroupRecord, world_size: int) -> int:
    """``S``: the bytes of quantized ``g``'s payload each rank homes (Note [Quantized
    shards])."""
    per = -(-g.quant.nbytes // world_size)
    return -(-per // _ALIGN) * _ALIGN


def home_shard(g: GroupRecord, swap, nbytes: int) -> torch.Tensor:
    """This rank's shard of quantized ``g``'s payload (``nbytes`` bytes) as a CPU uint8
    tensor, read from its home (host memory, device memory, or its NVMe extent)."""
    if g.host_buf is not None:
        return g.host_buf if g.host_buf.device.type == "cpu" else g.host_buf.cpu()
    if g.home != "nvme" or swap is None:
        raise RuntimeError(f"frozen_weights: group {g.gid} ({g.name}) has no readable home")
    from infinity.io import aligned_empty
    buf = aligned_empty(nbytes, torch.uint8)
    swap.read(g.extent, buf).wait()
    return buf


def gathered_values(g: GroupRecord, comm, swap) -> torch.Tensor:
    """Quantized ``g``'s flat values (working dtype, ``padded_numel``), dequantized from
    the payload gathered from every rank.  Collective (the ``default`` group)."""
    s = qshard_bytes(g, comm.world_size)
    blob = torch.empty(s * comm.world_size, dtype=torch.uint8)
    comm.all_gather_into(blob, home_shard(g, swap, s), group="default",
                         name=f"quantized payload of group {g.gid} ({g.name or '<root>'})")
    out = torch.zeros(g.padded_numel, dtype=g.dtype)
    g.quant.unpack(blob, out, g)
    return out


def write_gathered_values(g: GroupRecord, comm, swap, lo: int, mine: torch.Tensor) -> None:
    """A checkpoint load: this rank's element shard ``mine`` (working dtype, elements
    ``lo ..``) of quantized ``g``'s new values; every rank's shards are gathered, quantized
    again (the same bytes on every rank) and this rank's byte shard written to its home.
    Collective (the ``default`` group)."""
    ws = comm.world_size
    full = torch.zeros(mine.numel() * ws, dtype=g.dtype)
    comm.all_gather_into(full, mine.contiguous(), group="default",
                         name=f"loaded values of group {g.gid} ({g.name or '<root>'})")
    # the same base saved and loaded: the payload stays (see write_home_values); every rank
    # compares the same gathered tensors, so every rank decides alike
    if torch.equal(full[:g.padded_numel], gathered_values(g, comm, swap)):
        return
    s = qshard_bytes(g, ws)
    blob = torch.zeros(s * ws, dtype=torch.uint8)
    g.quant.pack(g, blob[:g.quant.nbytes], full[:g.padded_numel])
    r = comm.rank
    mine_b = blob[r * s:(r + 1) * s]
    if g.host_buf is not None:
        g.host_buf.copy_(mine_b)
        return
    from infinity.io import aligned_empty
    buf = aligned_empty(s, torch.uint8)
    buf.copy_(mine_b)
    swap.write(g.extent, buf).wait()


class QuantizedShards:
    """Placement and fetch of quantized groups at stage 3 (mixed into
    :class:`~infinity.zero.partitioned_memory.PartitionedMemoryManager`; Note [Quantized
    shards])."""

    def _qshard(self, g: GroupRecord) -> tuple[int, int]:
        s = qshard_bytes(g, self.part.world_size)
        return self.part.rank * s, s

    def _place_quantized(self, g: GroupRecord) -> None:
        r0, s = self._qshard(g)
        ws = self.part.world_size
        with self.host_pool.scoped(s * ws, torch.uint8) as full:
            full.zero_()
            g.quant.pack(g, full[:g.quant.nbytes])
            mine = full[r0:r0 + s]
            if g.home == "device":
                g.host_buf = self.device_pool.lease(s, torch.uint8)
                if self.dev.zero_copy:
                    g.host_buf.copy_(mine)
                else:
                    x = self.dev.h2d(g.host_buf, mine)
                    x.wait_host()
                    self.dev.compute_waits(x)
                self._resident[g.gid] = g.host_buf
            elif g.home == "cpu":
                g.host_buf = self.host_pool.lease(s, torch.uint8)
                g.host_buf.copy_(mine)
            elif g.home == "nvme":
                if self.swap is None:
                    raise RuntimeError("memory: NVMe home requested but no swap space was "
                                       "opened")
                g.extent = self.swap.allocate(s)
                t0 = time.perf_counter()
                self.swap.write(g.extent, mine).wait()
                self._link("nvme_write", s, t0)
            else:
                raise ValueError(f"memory: unknown home {g.home!r}")
        g.set_home_state()

    def _quantized_tile_start(self, g: GroupRecord, lo: int, hi: int):
        """Start gathering elements ``lo .. hi`` of quantized ``g`` across ranks (Note
        [Quantized shards]): the payload spans they need, piece by piece from each byte
        shard's owner.  Returns ``(future, tile view, tile lease, staging, span bytes,
        RangeRead, span offsets)``: the job's parts, decoded once it completed."""
        rr = g.quant.range_read(g, lo, hi)
        _, s = self._qshard(g)
        ws, me = self.part.world_size, self.comm.rank
        at, end = [], 0
        for _k, a, b in rr.spans:
            at.append(end)
            end = -(-(end + b - a) // 64) * 64
        pieces, mine = [], []              # (owner, blob offset, payload a, payload b)
        for (_k, a, b), o in zip(rr.spans, at):
            for r in range(a // s, min(ws, -(-b // s))):
                pa, pb = max(a, r * s), min(b, (r + 1) * s)
                if pa < pb:
                    pieces.append((r, o + pa - a, pa, pb))
        staging = blob = out = None
        try:
            if g.home == "nvme":           # this rank's pieces, each read 4 KiB-aligned
                for r, o, pa, pb in pieces:
                    if r == me:
                        a0 = (pa - me * s) // _ALIGN * _ALIGN
                        a1 = min(-(-(pb - me * s) // _ALIGN) * _ALIGN, g.extent.nbytes)
                        mine.append((o, pa, pb, a0, a1))
                if mine:
                    staging = self.host_pool.lease(max(a1 - a0 for *_, a0, a1 in mine),
                                                   torch.uint8)
            blob = self.dev.lease_or_overflow(max(end, 64), torch.uint8,
                                              "a quantized tile's payload bytes", True)
            out = self.dev.lease_or_overflow(rr.count * g.dtype.itemsize, g.dtype,
                                             "a parameter tile", True)
            name = f"a quantized tile of group {g.gid} ({g.name or '<root>'}) [{lo}, {hi})"
            fut = self._worker.submit(self._quantized_tile_job, g, blob, pieces, staging, name)
        except BaseException:
            if staging is not None:
                self.host_pool.give_back(staging)
            for b in (blob, out):
                if b is not None:
                    self.dev.give_back(b)
            raise
        return fut, out[lo - rr.first:hi - rr.first], out, staging, blob, rr, at

    def _quantized_tile_job(self, g: GroupRecord, blob: torch.Tensor, pieces, staging,
                            name: str):
        """Gather worker: this rank's pieces from its home into ``blob``, then every piece
        broadcast from its owner, in order; returns the completion marker."""
        _, s = self._qshard(g)
        me = self.comm.rank
        with self.dev.side_stream():
            self.dev.wait_free(blob)
            for r, o, pa, pb in pieces:
                if r != me:
                    continue
                a, b = pa - me * s, pb - me * s
                dst = blob[o:o + b - a]
                if g.home == "nvme":
                    a0 = a // _ALIGN * _ALIGN
                    a1 = min(-(-b // _ALIGN) * _ALIGN, g.extent.nbytes)
                    t0 = time.perf_counter()
                    self.swap.read(g.extent, staging[:a1 - a0], a0).wait()
                    self._link("nvme_read", a1 - a0, t0)
                    self.acct.count("frozen_nvme_read_bytes", a1 - a0)
                    self._copy_in(dst, staging[a - a0:b - a0])
                elif g.home == "device":
                    dst.copy_(g.host_buf[a:b])      # the resident shard
                else:
                    self.acct.count("frozen_host_read_bytes", b - a)
                    self._copy_in(dst, g.host_buf[a:b])
            for r, o, pa, pb in pieces:
                self.acct.count("frozen_allgather_bytes", pb - pa)
                self.comm.broadcast(blob[o:o + pb - pa], r, group="param", name=name)
            return self.dev.mark(blob)

    def _fetch_quantized_sharded(self, g: GroupRecord, allow_overflow: bool) -> bool:
        buf = self._lease_device(g, allow_overflow)
        if buf is None:
            return False
        r0, s = self._qshard(g)
        t0 = time.perf_counter()
        staging = blob = None
        try:
            blob = self.dev.lease_or_overflow(s * self.part.world_size, torch.uint8,
                                              "a quantized payload", True)
            if g.home == "nvme" and not self.dev.zero_copy:
                staging = self.host_pool.lease(s, torch.uint8)
            f = Fetch(PendingGather(self._worker.submit(self._gather_quantized, g, blob,
                                                        staging), staging), t0,
                      qsrc=blob, qowner=self.dev)
        except BaseException:
            if staging is not None:
                self.host_pool.give_back(staging)
            if blob is not None:
                self.dev.give_back(blob)
            self.dev.give_back(buf)
            raise
        if g.home == "nvme":
            g.begin_read(buf, f)
        else:
            g.begin_to_device(buf, f)
        self._inflight[g.gid] = g
        return True

    def _gather_quantized(self, g: GroupRecord, blob: torch.Tensor, staging):
        """Worker thread: this rank's payload shard into its slot of ``blob``, then the
        all-gather of the others into ``blob``; returns the completion marker."""
        r0, s = self._qshard(g)
        mine = blob[r0:r0 + s]
        name = f"quantized parameters of group {g.gid} ({g.name or '<root>'})"
        zpp = self.zeropp
        with self.dev.side_stream():
            if zpp is not None and zpp.has_secondary(g.gid):
                # hpZ: the backward's gather within the node, the home not read
                self.dev.wait_free(blob)
                self.acct.count("frozen_allgather_bytes", s * self.part.world_size)
                zpp.gather_payload(g.gid, blob, None, name)
                return self.dev.mark(blob)
            src = None
            if g.home == "device" or (g.home == "cpu" and self.dev.zero_copy):
                src = g.host_buf              # the resident shard / host home in place
                if g.home == "cpu":
                    self.acct.count("frozen_host_read_bytes", s)
                self.dev.wait_free(blob)
            else:
                if g.home == "nvme":
                    t0 = time.perf_counter()
                    self.swap.read(g.extent, mine if staging is None else staging).wait()
                    self._link("nvme_read", s, t0)
                    self.acct.count("frozen_nvme_read_bytes", s)
                    host = staging
                else:
                    host = g.host_buf
                    self.acct.count("frozen_host_read_bytes", s)
                if host is not None:          # separate device memory: H2D of the shard
                    x = self.dev.h2d(mine, host)
                    x.wait_host()
                    self._link("h2d", x.nbytes, x.t0, x.t_end)
                else:
                    self.dev.wait_free(blob)
            self.acct.count("frozen_allgather_bytes", s * self.part.world_size)
            if zpp is not None:         # (qwZ is never applied to a payload; hpZ keeps it)
                zpp.gather_payload(g.gid, blob, mine if src is None else src, name)
            else:
                self.comm.all_gather_into(blob, mine if src is None else src, group="param",
                                          name=name)
            return self.dev.mark(blob)
