"""Gradients leaving the device: the route from a parameter's gradient hook to its home
(:mod:`.route`), accumulation in fp32 (:mod:`.accumulate`, the gradient half of the step
driver), D2H copies out of separate device memory (:mod:`.d2h`) and the NVMe gradient
home (:mod:`.nvme_store`).  See docs/architecture.md."""
