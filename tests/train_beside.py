"""One training loop for an engine beside a plain-PyTorch reference (shared by tests)."""


def train_beside(eng, ref, opt, batches, after_step=None):
    """One engine step and one reference step (``ref`` with ``opt``) per batch of token
    ids; their losses."""
    losses, ref_losses = [], []
    for ids in batches:
        out = eng(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        r = ref(input_ids=ids, labels=ids)
        r.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        ref_losses.append(r.loss.item())
        if after_step is not None:
            after_step()
    return losses, ref_losses
