"""Gradients leaving the device: the route from a parameter's gradient hook to its home
(:mod:`.route`), D2H copies out of separate device memory (:mod:`.d2h`) and the NVMe
gradient home (:mod:`.nvme_store`).  Accumulation into the fp32 buffers is
:meth:`infinity.optim.driver.EngineOptimizer.accumulate`.  See docs/architecture.md."""
