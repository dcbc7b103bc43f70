"""``export_quantized``: a checkpoint's model as a compressed-tensors INT8/INT4 Hugging
Face directory (:mod:`.compressed`), optionally with layer-by-layer distillation
(:mod:`.lkd`), streamed: the checkpoint is read one tensor at a time (plus, with LKD, one
decoder block and the calibration activations), so the model is never whole in memory.

Which tensors are Linear weights comes from the model itself, built on the meta device
from the ``config.json`` the checkpoint's meta records (``infinity finetune`` checkpoints
do; :func:`~infinity.checkpoint.model_meta` for others). A LoRA checkpoint (``infinity
finetune --lora``) is quantized as its base model with the adapters merged
(:mod:`.lora_merge`): each adapted Linear's merged fp32 weight is what gets quantized.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from infinity.fsmode import makedirs
from infinity.quant import QuantizedTensor

from .calib_pages import CalibrationPages
from .compressed import (LinearPlan, QuantOptions, output_dtype, plan_linears,
                         quantization_config, set_quantization_config, write_quantized)
from .errors import CheckpointError
from .fsutil import check_path
from .export import DEFAULT_MAX_SHARD_BYTES, model_names, public_file_modes, write_model_config
from .lkd import LKDOptions, distil_block, quantized_mse, round_to_nearest
from .lora_merge import lora_checkpoint
from .reader import CheckpointReader

log = logging.getLogger("infinity.checkpoint")


def export_quantized(ckpt_dir, out_dir, tag=None, *, options: QuantOptions,
                     max_shard_bytes=DEFAULT_MAX_SHARD_BYTES, verify=True, meta_out=None,
                     lkd: LKDOptions | None = None, calib_ids: torch.Tensor | None = None,
                     calib_generate: tuple[int, int] = (8, 128), seed: int = 0,
                     report: dict | None = None):
    """Write the quantized export; returns the files written. ``lkd``: distil each
    block on ``calib_ids`` (``(n, T)`` token ids) or, when None, on ``calib_generate``
    = (sequences, length) tokens sampled from the model itself. ``report`` (a dict)
    receives per-block LKD losses and timings."""
    from .layerwise import linear_modules, meta_model
    t0 = time.monotonic()
    with CheckpointReader(ckpt_dir, tag) as r:
        if verify:
            r.verify()
        cfg = r.meta.get("model_config")
        if not isinstance(cfg, dict) or "model_type" not in cfg:
            raise CheckpointError(
                f"{r.path} does not record its model's config (meta['model_config']): a "
                f"quantized export needs it to know which tensors are Linear weights. Save the "
                f"checkpoint with extra_meta=model_meta(model) (infinity finetune does)")
        names = model_names(r)
        # a LoRA checkpoint: its base model's names, the adapters merged (.lora_merge)
        lora = lora_checkpoint(r, names)
        src = r if lora is None else lora
        if lora is not None:
            names = lora.names
        if options.include_lm_head and cfg.get("tie_word_embeddings", True) \
                and "lm_head.weight" not in names:
            raise CheckpointError(f"{r.path}: the LM head is tied to the input embedding (one "
                                  f"tensor), which stays 16-bit; drop --quantize-lm-head")
        plan = plan_linears(linear_modules(meta_model(cfg)), options)
        absent = [n for n in plan.layers if n not in src]
        if absent:
            raise CheckpointError(f"{r.path}: the model's Linear weights {absent[:5]} are not in the "
                                  f"checkpoint (were its tensors saved under other names?)")
        src_dtype = next((src.info(n)[1] for n in plan.layers), torch.float32)
        dtype16 = output_dtype(src_dtype, options)
        out_dir = check_path(out_dir, "export target")
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise CheckpointError(f"export target {out_dir} exists and is not a directory")
        makedirs(out_dir)
        if lora is None:
            get = r.read
        else:
            def get(n):     # a merged weight is quantized from fp32: one rounding, not two
                return lora.read(n, torch.float32) if n in plan else lora.read(n)
        lkd_src = None
        if lkd is not None:
            lkd_src = _LKDSource(src, cfg, names, plan, options, lkd, calib_ids, calib_generate,
                                 seed, dtype16, report if report is not None else {},
                                 swap_path=lkd.swap_path or out_dir)
            get, names = lkd_src.get, lkd_src.ordered(names)
        try:
            files, total = write_quantized(out_dir, names, src.info, get, plan, options,
                                           max_shard_bytes=max_shard_bytes)
        finally:
            if lkd_src is not None:
                lkd_src.close()
        cfg_files = write_model_config(r.meta, out_dir)
        set_quantization_config(cfg_files[0], quantization_config(plan, options), dtype16)
        files += cfg_files
        public_file_modes(out_dir, files)
        if meta_out is not None:
            meta_out.update(r.meta)
        if report is not None:
            report["seconds"] = time.monotonic() - t0
            report["bytes"] = total
            if lora is not None:
                report["lora"] = lora.describe()
        log.info("exported %s (%d Linear layers quantized, group %d) from %s to %s: %d bytes",
                 options.scheme, len(plan.layers), options.group_size, r.path, out_dir, total)
        return files


class _LKDSource:
    """``get(name)`` for the writer: a block's quantized Linear weights come out of its
    distillation (run when the first of its tensors is asked for; one block cached). The
    calibration activations entering the block and its 16-bit outputs are chunked and
    paged (:class:`~.calib_pages.CalibrationPages`)."""

    def __init__(self, reader, cfg, names, plan: LinearPlan, opts: QuantOptions,
                 lkd: LKDOptions, calib_ids, calib_generate, seed, dtype16, report, *,
                 swap_path):
        from .layerwise import LayerwiseModel
        self.r, self.plan, self.opts, self.lkd, self.dtype16 = reader, plan, opts, lkd, dtype16
        self.report = report
        self.lw = LayerwiseModel(cfg, reader.read, names)
        self.full = {}
        for i, local in enumerate(self.lw.block_names):
            for k, full in local.items():
                self.full[full] = (i, k)
        gen = torch.Generator().manual_seed(seed)
        if calib_ids is None:
            n, length = calib_generate
            t = time.monotonic()
            vocab = getattr(self.lw.shell.config, "vocab_size", None)
            calib_ids = self.lw.generate(n, length, bos=getattr(self.lw.shell.config, "bos_token_id", None),
                                         vocab=vocab, generator=gen)
            report["calib_generate_s"] = time.monotonic() - t
            report["calib_source"] = f"generated {n} x {length} by the model"
        else:
            report.setdefault("calib_source", f"{tuple(calib_ids.shape)} token ids")
        n_seq, seq_len = calib_ids.shape
        per = max(1, lkd.chunk_tokens // max(1, seq_len))
        self.spans = [(a, min(a + per, n_seq)) for a in range(0, n_seq, per)]
        self.pages = CalibrationPages(host_bytes=lkd.host_bytes, swap_path=swap_path)
        self.kwargs = {}                 # chunk size -> the keyword arguments blocks receive
        self.x = self.pages.new_set()    # activations entering the next block, chunk by chunk
        try:
            for j, (a, b) in enumerate(self.spans):
                hidden, kw = self.lw.block_inputs(calib_ids[a:b])
                self.kwargs.setdefault(b - a, kw)
                self.x.put(j, hidden)
                del hidden
        except BaseException:
            self.pages.close()
            raise
        self.elements = None
        self.next_block = 0
        self.cache: dict[str, QuantizedTensor] = {}
        self.cached_block = None
        report["blocks"] = []
        report["lkd_chunks"] = len(self.spans)
        report["lkd_pages"] = self.pages.stats

    def close(self) -> None:
        self.x.free()
        self.pages.close()

    def ordered(self, names):
        """Names in block order (each block's tensors together, blocks ascending)."""
        return sorted(names, key=lambda n: (self.full.get(n, (-1, ""))[0], names.index(n)))

    def get(self, name):
        if name not in self.full:
            return self.r.read(name)
        i, local = self.full[name]
        if name not in self.plan.layers:
            return self.r.read(name)
        while self.cached_block != i:
            self._distil(self.next_block)
        return self.cache[local]

    def _batches(self, y):
        """``batches`` for :mod:`.lkd`: (input chunk, kwargs, target chunk) in order."""
        def batches():
            for j, (a, b) in enumerate(self.spans):
                yield self.x.get(j), self.kwargs[b - a], y.get(j)
        batches.elements = self.elements
        return batches

    def _distil(self, i):
        if i >= self.lw.n_layers:
            raise CheckpointError(f"LKD: block {i} asked for out of order")
        t = time.monotonic()
        block = self.lw.load_block(i)
        y = self.pages.new_set()         # the 16-bit block's outputs: the targets
        try:
            elements = 0
            with torch.no_grad():
                for j, (a, b) in enumerate(self.spans):
                    out = self.lw.run_block(block, self.x.get(j), self.kwargs[b - a])
                    elements += out.numel()
                    y.put(j, out)
                    del out
            self.elements = elements
            weights = {}
            for local, full in self.lw.block_names[i].items():
                if full in self.plan.layers:
                    _, _strategy, g = self.plan.layers[full]
                    weights[local] = (self.opts.bits, g)
            batches = self._batches(y)
            rtn_q = round_to_nearest(block, weights, scale_dtype=self.dtype16)
            rtn = quantized_mse(block, batches, rtn_q)
            result, _first, _best = distil_block(block, batches, weights, self.lkd,
                                                 scale_dtype=self.dtype16, name=f"block {i}")
            mse = quantized_mse(block, batches, result)
        except BaseException:
            y.free()
            raise
        kept = "distilled"
        if mse > rtn:       # never write a block worse (on the calibration data) than plain rounding
            result, mse, kept = rtn_q, rtn, "round-to-nearest kept (distillation did not help)"
        self.report["blocks"].append({"block": i, "mse_rtn": rtn, "mse_lkd": mse, "kept": kept,
                                      "seconds": time.monotonic() - t})
        log.info("LKD block %d/%d: output MSE %.3g (round-to-nearest) -> %.3g in %d steps, %s "
                 "(%.1f s)", i + 1, self.lw.n_layers, rtn, mse, self.lkd.steps, kept,
                 time.monotonic() - t)
        self.cache = result
        self.cached_block = i
        self.x.free()
        self.x = y                  # the 16-bit model's activations feed the next block
        self.next_block = i + 1
