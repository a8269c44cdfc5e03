"""Recording values step by step on the device, and their means over an interval."""

import torch

from utils.distributed import all_reduce_sum, collective_device

FOLD_EVERY = 64  # recorded tensors kept per name before they are added up in one go


class Recorder:
    """Accumulates named values step by step; `summary()` returns their batch-size-weighted means.

    A recorded tensor is only kept (detached): no kernel runs per step. Every FOLD_EVERY values, and
    whenever the sums are read, the kept ones are added up on their device in float64 in one go, so
    recording never waits for the GPU; only `summary()` / `means()` copy the totals to the host, in one
    go. The points where values are added up depend only on what was recorded and read, so a resumed
    run adds up exactly as the run it continues. With `all_ranks=True` the sums and counts of every
    torchrun process are added first, so the means are those of all samples, as one process would
    compute them.
    """

    def __init__(self):
        self.sums = {}
        self.counts = {}
        self.kept = {}  # name -> {samples per value: [tensors]}, not yet in `sums`

    def record(self, name, value, n=1):
        """Add `value` (a tensor or number, the mean over `n` samples) under `name`."""
        if not torch.is_tensor(value):
            self.counts[name] = self.counts.get(name, 0) + n
            self.sums[name] = self.sums.get(name, 0.0) + float(value) * n
            return
        if value.numel() != 1:  # a batch's values, say: their sum would be added up as if it were a mean
            raise ValueError(f'record({name!r}, ...) takes one number (a mean), not a tensor of {tuple(value.shape)}')
        self.counts[name] = self.counts.get(name, 0) + n
        kept = self.kept.setdefault(name, {})
        kept.setdefault(n, []).append(value.detach().reshape(()))  # (one of shape (1,) stacks with 0-d ones)
        if sum(map(len, kept.values())) >= FOLD_EVERY:
            self._fold(name)

    def _fold(self, name):
        """Add the kept tensors of `name` to its sum: one stack and sum per batch size."""
        for n, values in self.kept.pop(name, {}).items():
            total = torch.stack(values).double().sum() * n
            self.sums[name] = self.sums[name] + total if name in self.sums else total

    def totals(self, all_ranks=False):
        """{name: (sum, count)} as host numbers (one sync; a collective when `all_ranks`)."""
        for name in list(self.kept):
            self._fold(name)
        names = list(self.counts)
        if not names:
            return {}
        device = next((v.device for v in self.sums.values() if torch.is_tensor(v)), None)
        device = collective_device() if all_ranks else device or torch.device('cpu')
        values = torch.stack(
            [torch.as_tensor(self.sums[name], dtype=torch.float64, device=device).reshape(()) for name in names]
            + [torch.tensor(float(self.counts[name]), dtype=torch.float64, device=device) for name in names]
        )
        if all_ranks:
            all_reduce_sum(values)
        host = values.tolist()
        return {name: (host[i], host[len(names) + i]) for i, name in enumerate(names)}

    def means(self, all_ranks=False):
        """The weighted mean of every recorded name, without resetting (a name with no samples yet: none)."""
        return {name: total / count for name, (total, count) in self.totals(all_ranks).items() if count}

    def state_dict(self):
        """This process's running sums and counts as plain numbers, for checkpoints (one host read and no
        communication: the checkpointer adds up those of every process)."""
        return {name: [total, count] for name, (total, count) in self.totals().items()}

    def load_state_dict(self, state):
        """Continue from sums saved by `state_dict` (under torchrun, rank 0 loads everyone's)."""
        self.sums = {name: total for name, (total, _) in state.items()}
        self.counts = {name: count for name, (_, count) in state.items()}
        self.kept = {}

    def summary(self, all_ranks=False):
        """The weighted means (see `means`), then a reset for the next interval."""
        means = self.means(all_ranks)
        self.sums.clear()
        self.counts.clear()
        return means
