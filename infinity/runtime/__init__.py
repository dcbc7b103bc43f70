"""The runtime every world size shares: grouping a model's parameters (:mod:`.groups`),
module / saved-tensor / gradient hooks that page groups around compute (:mod:`.hooks`)
and the trace-based prefetch (:mod:`.prefetch`).  See docs/architecture.md."""
