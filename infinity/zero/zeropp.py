"""ZeRO++ (Wang et al., 2023): qwZ, hpZ and qgZ on top of ZeRO stage 3 (qgZ: stages 2-3).

* **qwZ** (``zero_pp.quantized_weights``): a parameter all-gather sends this rank's shard
  block-quantized to int8 (symmetric, one fp32 scale per ``WEIGHT_BLOCK`` elements,
  :mod:`infinity.quant.blockwise`) and every rank dequantizes all W shards -- its own
  included -- into the compute buffer, so every rank computes with the same values.
  Bytes sent per element: 1 + 4/WEIGHT_BLOCK instead of 2 (bf16) or 4 (fp32).
* **hpZ** (``zero_pp.hpz_partition_size`` = N > 1): when a group is gathered in the
  forward pass, this rank also keeps a *secondary shard* of it, ``1/N`` of the group in
  the compute dtype (the values it computed with: dequantized under qwZ), partitioned
  over the ``N`` consecutive ranks of its block (typically its node).  The set is complete
  at the end of forward; every later gather of the group (backward, a second forward of an
  accumulation window) all-gathers only within the block, so it never leaves the node.
  The secondary shards are dropped before the optimizer updates the homes
  (:meth:`ZeroPP.invalidate`, from ``wait_host_reads``).  Memory: ``1/N`` of the
  parameters in the compute dtype per rank, on the device tier (in the placement plan).
* **qgZ** (``zero_pp.quantized_gradients``): a group's gradient reduce-scatter becomes a
  hierarchical all-to-all of int4 block-quantized gradients: quantize -> all-to-all within
  the node (each local peer j receives the chunks of the ranks with local index j on every
  node) -> dequantize, sum -> quantize -> all-to-all between the ranks with the same local
  index on the other nodes -> dequantize, sum.  Each rank ends with its chunk summed over
  all ranks (the caller averages it, as after a reduce-scatter).  Inter-node bytes per
  rank: ``(nodes-1)/W`` of the group at ~0.5 byte per element instead of ``(W-L)/W`` at 4.
  It runs on one worker thread (the only issuer on the intra/inter groups) so backward
  goes on while it runs, like the asynchronous reduce-scatter it replaces.

Nodes come from ``LOCAL_WORLD_SIZE`` (:mod:`infinity.zero.hierarchy`).  Non-finite values
are carried, not raised: a quantization block holding inf/NaN dequantizes to NaN (so a
non-finite gradient still makes the step skipped; a NaN weight still gives a NaN loss).
"""
from __future__ import annotations

import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.quant.kernel import dequantize_flat, quantize_flat
from infinity.zero.comm import Comm
from infinity.zero.hierarchy import Topology, new_subgroups

log = logging.getLogger("infinity.zero")

__all__ = ["ZeroPP", "WEIGHT_BLOCK", "GRAD_BLOCK", "WEIGHT_BITS", "GRAD_BITS",
           "qwz_wire_bytes", "qgz_wire_bytes"]

WEIGHT_BLOCK = 256     # elements per fp32 scale (qwZ)
GRAD_BLOCK = 64        # elements per fp32 scale (qgZ: int4 needs finer blocks than int8)
WEIGHT_BITS = 8
GRAD_BITS = 4


def qwz_wire_bytes(numel: int) -> int:
    """Bytes qwZ sends for ``numel`` weights (int8 + one fp32 scale per block)."""
    return numel + 4 * -(-numel // WEIGHT_BLOCK)


def qgz_wire_bytes(numel: int) -> int:
    """Bytes qgZ sends for ``numel`` gradients (packed int4 + one fp32 scale per block)."""
    return 4 * -(-numel // 8) + 4 * -(-numel // GRAD_BLOCK)


class _Reduction:
    """A qgZ reduction in flight (``wait()`` like a :class:`~infinity.zero.comm.CommHandle`):
    the worker's result, then the completion action."""
    __slots__ = ("fut", "post", "dev", "done_")

    def __init__(self, fut, post, dev):
        self.fut, self.post, self.dev, self.done_ = fut, post, dev, False

    def done(self) -> bool:
        """Whether ``wait()`` would return at once (never blocks)."""
        return self.done_ or self.fut.done()

    def wait(self) -> None:
        if self.done_:
            return
        self.done_ = True
        marker = self.fut.result()          # re-raises the worker's CollectiveError
        if self.dev is not None and marker is not None:
            self.dev.compute_waits(marker)
        if self.post is not None:
            post, self.post = self.post, None
            post()


class ZeroPP:
    """The ZeRO++ collectives of one engine.  Collective to construct: every rank creates
    the same sub-groups in the same order."""

    def __init__(self, cfg, comm: Comm):
        self.comm = comm
        self.qw = bool(cfg.quantized_weights)
        self.hpz = int(cfg.hpz_partition_size)
        self.qg = bool(cfg.quantized_gradients)
        self.topo = Topology.from_env(comm.rank, comm.world_size)
        t = comm.timeout_s
        if self.hpz > 1:
            pg, ranks = new_subgroups(self.topo.blocks(self.hpz), comm.rank, t)
            comm.add_group("hpz", pg, ranks)
        self.intra = self.inter = False
        if self.qg:
            if self.topo.local_size > 1:
                pg, ranks = new_subgroups(self.topo.intra_groups(), comm.rank, t)
                comm.add_group("intra", pg, ranks)
                self.intra = True
            if self.topo.nodes > 1:
                pg, ranks = new_subgroups(self.topo.inter_groups(), comm.rank, t)
                comm.add_group("inter", pg, ranks)
                self.inter = True
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"infinity-qgz-r{comm.rank}") \
            if self.qg else None
        self.dev = None
        self._secondary: dict[int, torch.Tensor] = {}
        self._leased: dict[int, torch.Tensor] = {}
        self._valid: set[int] = set()
        log.info("ZeRO++ on rank %d: qwZ %s, hpZ %d, qgZ %s (%d node(s) x %d rank(s))",
                 comm.rank, self.qw, self.hpz, self.qg, self.topo.nodes, self.topo.local_size)

    def attach_device(self, dev) -> None:
        """The device tier the secondary shards live on (the manager's)."""
        self.dev = dev

    # ------------------------------------------------------------------ parameters
    def secondary_numel(self, padded_numel: int) -> int:
        return padded_numel // self.hpz if self.hpz > 1 else 0

    def gather_params(self, gid: int, buf: torch.Tensor, shard: torch.Tensor,
                      name: str) -> None:
        """Fill ``buf`` (the whole group) from every rank's ``shard`` (fetch worker thread)."""
        if gid in self._valid:
            self.comm.all_gather_into(buf, self._secondary[gid], group="hpz",
                                      name=name + " from the hpZ secondary partition")
            return
        if self.qw:
            self._gather_quantized(buf, shard, name)
        else:
            self.comm.all_gather_into(buf, shard, group="param", name=name)
        if self.hpz > 1:
            self._keep_secondary(gid, buf)

    def has_secondary(self, gid: int) -> bool:
        """Whether ``gid``'s next gather can come from the hpZ secondary partition."""
        return gid in self._valid

    def gather_payload(self, gid: int, blob: torch.Tensor, mine: torch.Tensor | None,
                       name: str) -> None:
        """A quantized frozen group's payload bytes (Note [Quantized shards]): from the hpZ
        secondary partition when it is valid (``mine`` unused: the home is not read), else
        one all-gather of every rank's byte shard ``mine`` -- never quantized again by qwZ
        -- kept as this rank's secondary shard when hpZ is on."""
        if gid in self._valid:
            self.comm.all_gather_into(blob, self._secondary[gid], group="hpz",
                                      name=name + " from the hpZ secondary partition")
            return
        self.comm.all_gather_into(blob, mine, group="param", name=name)
        if self.hpz > 1:
            self._keep_secondary(gid, blob)

    def _gather_quantized(self, buf: torch.Tensor, shard: torch.Tensor, name: str) -> None:
        """One all-gather of [int8 values | fp32 scales as bytes] per rank, then every
        rank's shard dequantized into ``buf`` (its own included)."""
        w = self.comm.world_size
        q, sc = quantize_flat(shard, WEIGHT_BITS, WEIGHT_BLOCK)
        nq, ns = q.numel(), sc.numel() * 4
        mine = torch.empty(nq + ns, dtype=torch.uint8, device=buf.device)
        mine[:nq].copy_(q.view(torch.uint8))
        mine[nq:].copy_(sc.view(torch.uint8))
        rows = torch.empty(w, nq + ns, dtype=torch.uint8, device=buf.device)
        self.comm.all_gather_into(rows.view(-1), mine, group="param", name=name + " (qwZ int8)")
        q_all = rows[:, :nq].contiguous().view(torch.int8).view(-1)
        s_all = rows[:, nq:].contiguous().view(torch.float32).view(-1)
        dequantize_flat(q_all, s_all, buf.numel(), WEIGHT_BITS, WEIGHT_BLOCK, buf)

    def _keep_secondary(self, gid: int, buf: torch.Tensor) -> None:
        n = buf.numel() // self.hpz
        i = self.comm.group_ranks("hpz").index(self.comm.rank)
        sec = self._secondary.get(gid)
        if sec is None:
            nbytes = n * buf.element_size()
            raw = self.dev.lease_or_overflow(nbytes, buf.dtype, "an hpZ secondary shard") \
                if self.dev is not None else torch.empty(n, dtype=buf.dtype)
            self._leased[gid] = raw
            self._secondary[gid] = sec = raw[:n]
        sec.copy_(buf[i * n:(i + 1) * n])
        self._valid.add(gid)

    def invalidate(self) -> None:
        """The homes are about to change (optimizer step, checkpoint load): the next
        gather of every group goes to the primary partition again."""
        self._valid.clear()

    def secondary_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._secondary.values())

    # ------------------------------------------------------------------ gradients
    def reduce_scatter_sum(self, out: torch.Tensor, full: torch.Tensor, *, group: str = "grad",
                           async_op: bool = True, post=None, name: str = "") -> _Reduction:
        """qgZ in place of :meth:`Comm.reduce_scatter_sum` (same arguments): ``out``
        receives this rank's chunk of ``full`` summed over every rank."""
        w = self.comm.world_size
        if full.numel() != out.numel() * w:
            raise ValueError(f"qgZ: input has {full.numel()} elements, expected {w} x "
                             f"{out.numel()}")
        marker = self.dev.mark(full) if self.dev is not None else None
        h = _Reduction(self._worker.submit(self._qgz, out, full, name, marker), post, self.dev)
        if not async_op:
            h.wait()
            return None
        return h

    def _exchange(self, rows: torch.Tensor, group: str, name: str) -> torch.Tensor:
        """Quantize ``rows`` (one row per peer of ``group``, in group order), all-to-all them
        (one collective: each row [packed int4 words | fp32 scales as int32]) and return the
        dequantized rows received (fp32, same shape)."""
        p, n = rows.shape
        if n % GRAD_BLOCK:
            raise ValueError(f"qgZ: rows of {n} elements are not whole blocks of {GRAD_BLOCK}")
        q, sc = quantize_flat(rows.contiguous(), GRAD_BITS, GRAD_BLOCK)
        q, sc = q.view(p, -1), sc.view(p, -1)
        nq = q.shape[1]
        send = torch.cat([q, sc.view(torch.int32)], dim=1)
        got = torch.empty_like(send)
        self.comm.all_to_all_into(got, send, group=group, name=name + " (qgZ int4)")
        out = torch.empty(p, n, dtype=torch.float32, device=rows.device)
        return dequantize_flat(got[:, :nq].contiguous().view(-1),
                               got[:, nq:].contiguous().view(torch.float32).view(-1),
                               p * n, GRAD_BITS, GRAD_BLOCK, out)

    def _qgz(self, out: torch.Tensor, full: torch.Tensor, name: str, marker):
        """Worker thread: the two-level quantized reduction of ``full`` into ``out``."""
        topo, dev = self.topo, self.dev
        side = dev.side_stream() if dev is not None else contextlib.nullcontext()
        with side:
            if marker is not None:
                dev.compute_waits(marker)     # backward's writes to ``full`` are done
            s = out.numel()
            x = full.view(topo.nodes, topo.local_size, s)   # [node, local index, chunk]
            if self.intra:
                # row j: the chunks of the ranks with local index j (every node)
                rows = x.transpose(0, 1).reshape(topo.local_size, topo.nodes * s)
                partial = self._exchange(rows, "intra", name).sum(0)
            else:
                partial = x[:, topo.local_rank, :].reshape(-1).float()
            if self.inter:
                total = self._exchange(partial.view(topo.nodes, s), "inter", name).sum(0)
            else:
                total = partial
            out.copy_(total)
            return dev.mark(out) if dev is not None else None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        if self.dev is not None:
            for t in self._leased.values():
                try:
                    self.dev.give_back(t)
                except Exception as e:  # noqa: BLE001 - closing after an error
                    log.debug("zero_pp: giving back a secondary shard failed: %s", e)
        self._secondary.clear()
        self._leased.clear()
        self._valid.clear()


