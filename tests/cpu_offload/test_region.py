"""``CPUOffload`` with the copy path forced on CPU tensors, against runs without offload.

Reference: the same model, data and seed without any region. Tolerance: none; offload moves bytes and
rebuilds every saved view with its own layout, so gradients must be bitwise equal.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from examples.gpt.model import GPT, config, lm_loss
from lightning_haiscale.cpu_offload import CPUOffload, PinnedBufferPool, offload_stats, reset_offload_stats
from lightning_haiscale.cpu_offload import run as run_module
from lightning_haiscale.cpu_offload.stats import region_record
from lightning_haiscale.cpu_offload.transfer import HostCopies
from lightning_haiscale.testing.parity import noise_tolerance
from tests.saved_hooks import installed_hooks

_TAGS = itertools.count()


def _tag() -> str:
    return f"test-region-{next(_TAGS)}"


def _hooks_top():
    return installed_hooks()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = GPT(config("tiny", n_layer=2))
    idx = torch.randint(0, 256, (2, 64))
    return model, idx, torch.roll(idx, -1, dims=1)


def _grads(model, idx, targets, region=None, ckpt=False):
    model.zero_grad(set_to_none=True)

    def forward():
        h = idx
        for layer in model:
            h = checkpoint(layer, h, use_reentrant=False) if ckpt and layer is not model[0] else layer(h)
        return lm_loss(h, targets)

    if region is None:
        loss = forward()
    else:
        with region:
            loss = forward()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def _assert_bitwise_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g - w).abs().max()


@pytest.mark.parametrize("ratio", [0.0, 0.3, 0.5, 1.0])
def test_gradients_bitwise_equal_and_ratio_within_one_tensor(gpt, ratio):
    model, idx, targets = gpt
    want = _grads(model, idx, targets)
    tag = _tag()
    for entry in range(2):  # the first entry measures, the second follows the plan
        got = _grads(model, idx, targets, CPUOffload(ratio, tag, min_bytes=0, force_copy=True))
        _assert_bitwise_equal(got, want)
        stats = offload_stats(tag)
        assert stats.entries == entry + 1 and stats.bytes_saved > 0
    largest = model[1].mlp.c_fc.out_features * idx.numel() * 4  # a (B, T, 4C) fp32 activation
    assert abs(stats.bytes_offloaded - ratio * stats.bytes_saved) <= largest
    assert (stats.bytes_offloaded == 0) == (ratio == 0)
    assert (stats.bytes_offloaded == stats.bytes_saved) == (ratio == 1)
    assert stats.copy_seconds >= 0


def test_saved_twice_is_copied_once_and_parameters_do_not_count():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with CPUOffload(1.0, min_bytes=0, force_copy=True) as region:
        y = (x @ w).relu()  # saves x (w is a leaf that requires grad: resident) and relu's result y
        loss = (y * y).sum()  # saves y twice more
    stats = region.stats()
    assert stats.tensors_saved == 2 and stats.tensors_offloaded == 2
    assert stats.bytes_saved == 2 * x.numel() * 4
    loss.backward()
    want = w.grad.clone()
    w.grad = None
    ((x @ w).relu() ** 2).sum().backward()
    assert torch.equal(w.grad, want)


def test_no_hook_outside_the_region(gpt):
    model, idx, targets = gpt
    assert _hooks_top() is None
    region = CPUOffload(0.5, _tag(), min_bytes=0, force_copy=True)
    with region:
        assert _hooks_top() is not None
        loss = lm_loss(model(idx), targets)
    assert _hooks_top() is None
    before = region.stats()
    lm_loss(model(idx), targets).backward()  # saved outside: nothing packed, nothing counted
    loss.backward()
    after = region.stats()
    assert (after.entries, after.total_bytes_saved) == (before.entries, before.total_bytes_saved)


def test_region_leaves_on_exception():
    with pytest.raises(ZeroDivisionError), CPUOffload(0.5, force_copy=True):
        raise ZeroDivisionError
    assert _hooks_top() is None


def test_cpu_tensors_untouched_by_default(gpt):
    model, idx, targets = gpt
    with CPUOffload(1.0, min_bytes=0) as region:
        lm_loss(model(idx), targets)
    assert region.stats().bytes_saved == 0


def test_composes_with_checkpointing(gpt):
    model, idx, targets = gpt
    want = _grads(model, idx, targets, ckpt=True)
    region = CPUOffload(1.0, min_bytes=0, force_copy=True)
    _assert_bitwise_equal(_grads(model, idx, targets, region, ckpt=True), want)
    assert region.stats().bytes_offloaded > 0  # the checkpoints' inputs and the head's activations


def test_nested_regions_and_tags_account_separately(gpt):
    model, idx, targets = gpt
    want = _grads(model, idx, targets)
    model.zero_grad(set_to_none=True)
    outer, inner = _tag(), _tag()
    with CPUOffload(1.0, outer, min_bytes=0, force_copy=True):
        h = model[0](idx)
        with CPUOffload(0.0, inner, min_bytes=0, force_copy=True):
            h = model[1](h)
        for layer in list(model)[2:]:
            h = layer(h)
        loss = lm_loss(h, targets)
    loss.backward()
    _assert_bitwise_equal([p.grad for p in model.parameters()], want)
    assert offload_stats(outer).achieved_ratio == 1.0
    assert offload_stats(inner).bytes_saved > 0 and offload_stats(inner).bytes_offloaded == 0
    with CPUOffload(0.5, outer, force_copy=True), pytest.raises(RuntimeError, match="already active"):
        CPUOffload(0.5, outer).__enter__()
    reset_offload_stats(outer)
    with pytest.raises(KeyError, match=outer):
        offload_stats(outer)


def test_plan_follows_a_change_of_shapes(gpt):
    model, idx, targets = gpt
    tag = _tag()
    for length in (64, 32, 32):
        want = _grads(model, idx[:, :length], targets[:, :length])
        got = _grads(model, idx[:, :length], targets[:, :length], CPUOffload(0.5, tag, min_bytes=0, force_copy=True))
        _assert_bitwise_equal(got, want)
        assert abs(offload_stats(tag).achieved_ratio - 0.5) < 0.1


def test_retain_graph_backward_twice(gpt):
    model, idx, targets = gpt
    model.zero_grad(set_to_none=True)
    lm_loss(model(idx), targets).backward()
    want = [2 * p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with CPUOffload(0.5, min_bytes=0, force_copy=True, prefetch_bytes=0):
        loss = lm_loss(model(idx), targets)
    loss.backward(retain_graph=True)
    loss.backward()
    _assert_bitwise_equal([p.grad for p in model.parameters()], want)  # g + g == 2 * g exactly


@pytest.mark.parametrize("name", ["min_bytes", "max_inflight_bytes", "prefetch_bytes"])
def test_bad_sizes_name_the_parameter(name):
    with pytest.raises(ValueError, match=name):
        CPUOffload(0.5, **{name: -1})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ratio", [0.3, 1.0])
def test_cuda_gradients_match(ratio):
    """Bitwise where two reference runs agree bitwise (CUDA backward kernels may use atomics); otherwise within
    ``noise_tolerance`` of the two reference runs' own difference ([Note: parity tolerances])."""
    torch.manual_seed(0)
    model = GPT(config("tiny")).cuda()
    idx = torch.randint(0, 256, (4, 256), device="cuda")
    targets = torch.roll(idx, -1, dims=1)
    want = _grads(model, idx, targets)
    noise = max((a - b).abs().max().item() for a, b in zip(_grads(model, idx, targets), want, strict=True))
    atol = noise_tolerance(noise, scale=max(w.abs().max().item() for w in want))
    tag = _tag()
    for _ in range(3):  # small windows: forces throttling, prefetch and buffer reuse
        region = CPUOffload(ratio, tag, min_bytes=0, max_inflight_bytes=1 << 20, prefetch_bytes=1 << 20)
        got = _grads(model, idx, targets, region)
        if noise == 0:
            _assert_bitwise_equal(got, want)
        else:  # this GPU's backward kernels reorder their sums run to run: a multiple of that run-to-run noise
            torch.testing.assert_close(got, want, rtol=0, atol=atol)
    stats = offload_stats(tag)
    assert stats.bytes_offloaded > 0 and stats.copy_seconds > 0
    assert abs(stats.achieved_ratio - ratio) < 0.1


class _Event:
    """Stands in for a CUDA event whose copy has not finished until someone waits on it."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _SlowTransfer(HostCopies):
    """Host copies that report themselves unfinished: exercises the CUDA path's bookkeeping on CPU."""

    def __init__(self, device, clock) -> None:
        super().__init__(device, clock)
        self.waited = self.kept = 0

    def to_host(self, source, buf):
        super().to_host(source, buf)
        return _Event()

    def to_device(self, buf, written):
        data, _ = super().to_device(buf, written)
        return data, _Event(done=True)

    def wait(self, event) -> None:
        self.waited += 1
        event.done = True

    def keep_until_read(self, source) -> None:
        self.kept += 1


@pytest.fixture
def slow_transfer(monkeypatch):
    made = []

    def transfer(self, device):
        if device not in self._copies:
            self._copies[device] = _SlowTransfer(device, self.clock)
            made.append(self._copies[device])
        return self._copies[device]

    monkeypatch.setattr(run_module.OffloadRun, "_copies_for", transfer)
    return made


def test_inflight_window_and_source_reuse(gpt, slow_transfer):
    model, idx, targets = gpt
    want = _grads(model, idx, targets)
    window = 200_000
    region = CPUOffload(1.0, min_bytes=0, force_copy=True, max_inflight_bytes=window)
    got = _grads(model, idx, targets, region)
    _assert_bitwise_equal(got, want)  # the last spans come back from their still-held device bytes
    (transfer,) = slow_transfer
    assert transfer.waited > 0  # compute waited for the oldest copies once the window was full
    assert transfer.kept > 0  # reused device bytes, released after backward while their copy "runs", are protected


def test_graph_dropped_before_backward_protects_copies_in_flight(gpt, slow_transfer):
    model, idx, targets = gpt
    with CPUOffload(1.0, min_bytes=0, force_copy=True, max_inflight_bytes=1 << 30):
        loss = lm_loss(model(idx), targets)
    del loss  # no backward: the held device bytes are released while their copies "run"
    (transfer,) = slow_transfer
    assert transfer.kept > 0 and transfer.waited == 0


@pytest.mark.parametrize("slow", [False, True], ids=["copied-back", "source-reused"])
def test_slices_of_large_storages_copy_only_their_span(slow, request):
    if slow:
        request.getfixturevalue("slow_transfer")
    big = torch.randn(1000, 64)
    w = torch.randn(64, 8, requires_grad=True)
    with CPUOffload(1.0, min_bytes=0, force_copy=True) as region:
        loss = (big[500:510] @ w).sum() + (big[600:620, ::2] @ w[::2]).sum()  # a slice, a strided slice
    assert region.stats().bytes_saved == 10 * 64 * 4 + (19 * 64 + 63) * 4  # spans, not the whole storage
    loss.backward()
    want = w.grad.clone()
    w.grad = None
    ((big[500:510] @ w).sum() + (big[600:620, ::2] @ w[::2]).sum()).backward()
    assert torch.equal(w.grad, want)


def test_small_tensors_stay_resident_but_count(gpt):
    model, idx, targets = gpt
    with CPUOffload(1.0, min_bytes=1 << 30, force_copy=True) as region:
        lm_loss(model(idx), targets)
    stats = region.stats()
    assert stats.bytes_saved > 0 and stats.bytes_offloaded == 0


def test_resized_storage_is_copied_back_not_reused(slow_transfer):
    x = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    with CPUOffload(1.0, min_bytes=0, force_copy=True):
        loss = (x @ w).sum()
    want = x.clone()
    x.untyped_storage().resize_(0)  # what FSDP does to unsharded parameters after forward
    loss.backward()
    got, w.grad = w.grad, None
    (want @ w).sum().backward()
    assert torch.equal(got, w.grad)


def test_span_saved_again_after_its_first_saves_were_released():
    x = torch.randn(64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    with CPUOffload(1.0, min_bytes=0, force_copy=True) as region:
        (x @ w).sum()  # a graph released at once: x's first save is dropped
        loss = (x @ w).sum()
    assert region.stats().bytes_saved == x.numel() * 4  # still counted once
    loss.backward()
    got, w.grad = w.grad, None
    (x @ w).sum().backward()
    assert torch.equal(got, w.grad)


def test_ratio_0_measures_what_the_general_path_measures(gpt):
    """Ratio 0 counts at exit (see [Note: the cost of the hooks]); 1e-9 offloads nothing either, via ``pack``."""
    model, idx, targets = gpt
    measured = []
    for ratio in (0.0, 1e-9):
        tag = _tag()
        with CPUOffload(ratio, tag, min_bytes=4096, force_copy=True) as region:
            loss = lm_loss(model(idx), targets)
        loss.backward()
        stats, sizes = region.stats(), region_record(tag).candidate_sizes
        assert stats.bytes_offloaded == 0 and stats.tensors_saved > len(sizes) > 0
        assert all(n >= 4096 for n in sizes)
        measured.append((stats.bytes_saved, stats.tensors_saved, sizes))
    assert measured[0] == measured[1]


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_each_storage_span_counts_once(ratio):
    w = torch.randn(64, 64, requires_grad=True)
    x, big = torch.randn(32, 64), torch.randn(1000, 64)
    with CPUOffload(ratio, min_bytes=0, force_copy=True) as region:
        y = (x @ w).relu()  # x and y; w is a leaf that requires grad: not counted
        loss = (y * y).sum() + (w.t()[:, :8] * 2).sum()  # y twice more; a view of w: not counted
        (big[500:510] @ w).sum()  # a slice of a large storage counts its span; graph released at once
        loss = loss + (big[500:510] @ w).sum()  # the same span saved again after its first save was released
        first = torch.randn(16, 64)
        (first @ w).sum()
        del first
        loss = loss + (torch.randn(16, 64) @ w).sum()  # another storage, maybe at the freed address
    stats = region.stats()
    assert stats.tensors_saved == 5
    assert stats.bytes_saved == (2 * 32 * 64 + 10 * 64 + 2 * 16 * 64) * 4
    assert stats.bytes_offloaded == ratio * stats.bytes_saved
    loss.backward()


def test_a_ratio_0_entry_plans_the_next_entry(gpt):
    model, idx, targets = gpt
    tag = _tag()
    _grads(model, idx, targets, CPUOffload(0.0, tag, min_bytes=0, force_copy=True))
    measured = list(region_record(tag).candidate_sizes)
    got = _grads(model, idx, targets, CPUOffload(0.5, tag, min_bytes=0, force_copy=True))
    _assert_bitwise_equal(got, _grads(model, idx, targets))
    assert region_record(tag).candidate_sizes == measured  # the ratio 0.5 entry measured the same sequence
    assert abs(offload_stats(tag).achieved_ratio - 0.5) < 0.1


def test_each_offloaded_span_is_copied_out_once_and_its_buffer_returned(gpt, monkeypatch):
    model, idx, targets = gpt
    copies = []
    to_host = HostCopies.to_host

    def counted_to_host(self, source, buf):
        copies.append(source.numel())
        return to_host(self, source, buf)

    monkeypatch.setattr(HostCopies, "to_host", counted_to_host)
    pool = PinnedBufferPool()
    for _ in range(2):
        copies.clear()
        region = CPUOffload(1.0, min_bytes=0, force_copy=True, pool=pool)
        _grads(model, idx, targets, region)
        stats = region.stats()
        assert len(copies) == stats.tensors_offloaded > 0
        assert sum(len(free) for free in pool._free.values()) == stats.tensors_offloaded  # all back, reused


def _installed_pack():
    return installed_hooks()[0]


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_handles_detach_only_tensors_that_own_a_graph_node(ratio):
    """A parameter and a tensor that needs no grad are their own handles; an activation's is detached."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(8, 8)
    y = x @ p
    with CPUOffload(ratio, min_bytes=1 << 30, force_copy=True) as region:  # resident: handles are the tensors
        pack = _installed_pack()
        handles = [pack(t) for t in (p, x, y)]
    if ratio:  # the general path's resident handle is (save order, tensor)
        handles = [h[1] for h in handles]
    assert handles[0] is p and handles[1] is x
    assert handles[2] is not y and handles[2].grad_fn is None and handles[2].data_ptr() == y.data_ptr()
    assert region.stats().tensors_saved == 2  # x and y; the parameter is not counted


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_a_saved_output_is_freed_with_its_dropped_graph(ratio):
    """exp saves its own output: a handle holding that tensor undetached would be a cycle, never freed."""
    x = torch.randn(64, 64, requires_grad=True)
    with CPUOffload(ratio, min_bytes=0, force_copy=True):
        y = x.exp()
    alive = weakref.ref(y)
    del y
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_frozen_parameters_and_their_views_do_not_count_buffers_do(ratio):
    frozen = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    buffer = torch.randn(4, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with CPUOffload(ratio, min_bytes=0, force_copy=True) as region:
        loss = (((x @ frozen.t()) * buffer) * frozen[0]).sum()  # saves frozen.t(), buffer, frozen[0]
    stats = region.stats()
    assert (stats.tensors_saved, stats.bytes_saved) == (1, buffer.nbytes)
    loss.backward()
    got, x.grad = x.grad, None
    (((x @ frozen.t()) * buffer) * frozen[0]).sum().backward()
    assert torch.equal(got, x.grad)


def test_ratio_0_spans_of_views_are_the_general_paths():
    """The span rule on strided, overlapping (expanded) and transposed views, at ratio 0 and at ratio 1."""
    big, small = torch.randn(1000, 64), torch.randn(100)
    w, u, v = (torch.randn(*shape, requires_grad=True) for shape in ((64, 8), (1000, 2), (10,)))
    measured = []
    for ratio in (0.0, 1.0):
        with CPUOffload(ratio, min_bytes=0, force_copy=True) as region:
            loss = (big[600:620, ::2] @ w[::2]).sum() + (big.t()[:8] @ u).sum()  # a strided slice, 8 columns
            loss = loss + (small[:10].expand(10, 10) * v).sum()  # an overlapping view: its extent is 10 elements
        stats = region.stats()
        measured.append((stats.tensors_saved, stats.bytes_saved))
        loss.backward()
    assert measured[0] == measured[1] == (3, (19 * 64 + 63) * 4 + big.nbytes + 10 * 4)


def test_ratio_0_does_no_device_work_per_saved_tensor(gpt, monkeypatch):
    """At ratio 0 the hooks never reach a copy, a stream, an event or a host buffer (all live in those)."""
    model, idx, targets = gpt

    def refuse(*args, **kwargs):
        raise AssertionError("ratio 0 reached the copy machinery")

    monkeypatch.setattr(run_module.OffloadRun, "_copies_for", refuse)
    monkeypatch.setattr(PinnedBufferPool, "acquire", refuse)
    region = CPUOffload(0.0, _tag(), min_bytes=0, force_copy=True)
    _assert_bitwise_equal(_grads(model, idx, targets, region), _grads(model, idx, targets))
    assert region.stats().tensors_saved > 0


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_storage_counts_again_in_each_entry_and_once_within_one(ratio):
    """Ratio 0 marks a counted storage with its entry's token: a later entry counts it again, one entry once."""
    w = torch.randn(64, 64, requires_grad=True)
    x, big = torch.randn(32, 64), torch.randn(100, 64)
    region = CPUOffload(ratio, min_bytes=0, force_copy=True)
    for _ in range(2):
        with region:
            loss = (x @ w).sum() + (x.t()[:, :16] @ w[:16]).sum()  # x, then a view of x covering half of it
            loss = loss + (big[:10] @ w).sum() + (big[:10] @ w).sum() + (big[50:60] @ w).sum()  # two spans of big
            loss = loss + (big @ w).sum()  # big whole, after two of its spans
        stats = region.stats()
        assert stats.tensors_saved == 4
        assert stats.bytes_saved == x.nbytes + 2 * 10 * 64 * 4 + big.nbytes
        loss.backward()


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_a_storage_saved_again_at_a_new_address_counts_again(ratio):
    """A span is its storage's bytes where they are: a storage resized between two saves holds new bytes."""
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with CPUOffload(ratio, min_bytes=0, force_copy=True) as region:
        loss = (x @ w).sum()
        storage = x.untyped_storage()
        address = storage.data_ptr()
        storage.resize_(2 * x.nbytes)  # new bytes, allocated while the old ones are copied: a new address
        assert storage.data_ptr() != address
        x.set_(storage, 0, (32, 64))  # half of the storage: its span is the whole storage
        loss = loss + (x @ w).sum()
    assert region.stats().tensors_saved == 2 and region.stats().bytes_saved == 3 * x.nbytes


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_conjugate_views_count_and_stay_resident(ratio):
    """A conjugate or negative view's bytes are saved like any other: counted, never copied (the copy path
    cannot rebuild the bit); gradients are those of a run without the region."""
    z = torch.randn(32, 32, dtype=torch.complex64)
    w = torch.randn(32, 32, dtype=torch.complex64, requires_grad=True)

    def loss_of():
        return (z.conj() @ w).abs().sum() + (z.conj().imag @ w.real).sum()  # a conjugate view, a negative one

    with CPUOffload(ratio, min_bytes=0, force_copy=True) as region:
        loss = loss_of()
    stats = region.stats()
    assert stats.bytes_saved >= z.nbytes and stats.bytes_offloaded <= stats.bytes_saved - z.nbytes
    loss.backward()
    got, w.grad = w.grad, None
    loss_of().backward()
    assert torch.equal(got, w.grad)


def test_ratio_0_candidates_leave_out_what_cannot_be_copied():
    """The candidate sizes (the next entry's plan) of ratio 0 are those of the general path, conjugates left out."""
    z = torch.randn(512, 512, dtype=torch.complex64)  # 2 MiB, over the default min_bytes
    x = torch.randn(512, 512)
    w, v = torch.randn(512, 8, dtype=torch.complex64, requires_grad=True), torch.randn(512, 8, requires_grad=True)
    measured = []
    for ratio in (0.0, 1e-9):
        tag = _tag()
        with CPUOffload(ratio, tag, force_copy=True) as region:
            (z.conj() @ w).real.sum() + (x @ v).sum()
        stats = region.stats()
        measured.append((stats.tensors_saved, stats.bytes_saved, region_record(tag).candidate_sizes))
    assert measured[0] == measured[1] == (2, z.nbytes + x.nbytes, [x.nbytes])


@pytest.mark.parametrize("ratio", [0.0, 0.5])
def test_a_dropped_graph_frees_every_saved_activation_and_storage(gpt, ratio):
    """Nothing the hooks keep (handles, counted-span marks) holds a saved activation once its graph is dropped."""
    model, idx, targets = gpt
    kept = []

    def keep(module, args, out):
        kept.append(weakref.ref(out))
        kept.append(weakref.ref(out.untyped_storage()))

    hooks = [m.register_forward_hook(keep) for m in model.modules() if not list(m.children())]
    try:
        with CPUOffload(ratio, min_bytes=0, force_copy=True):
            loss = lm_loss(model(idx), targets)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(kept) > 10
    del loss
    gc.collect()
    assert [r for r in kept if r() is not None] == []


def test_ratio_0_a_view_of_a_trainable_parameter_is_its_own_handle_others_are_detached():
    """A view of a leaf that requires grad has only its view node: no cycle, no detach. A frozen parameter's
    view made to require grad in place has another node (here one that saves the view): its handle is
    detached, and the view is freed with its dropped graph."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    frozen = torch.nn.Parameter(torch.randn(8, 8), requires_grad=False)
    x = torch.randn(8, requires_grad=True)
    view = p.t()
    with CPUOffload(0.0, min_bytes=0, force_copy=True) as region:
        assert _installed_pack()(view) is view
        row = frozen[0]
        row.mul_(x)  # row (and frozen) now require grad, through in-place nodes
        row.exp_()  # saves its result: row itself
    assert region.stats().tensors_saved == 1  # mul_'s copy of row's old values; row, a view of frozen, is not
    alive = weakref.ref(row)
    del row
    gc.collect()
    assert alive() is None


def test_ratio_0_hooks_dispatch_no_operator(gpt):
    """Everything the ratio-0 pair asks of a saved tensor is metadata: no operator but ``detach`` (what
    ``.data`` becomes under a dispatch mode, a view) is dispatched, so on a GPU nothing per saved tensor
    reaches the device or its stream."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model, idx, targets = gpt
    saved = []

    def capture(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(capture, lambda t: t):
        lm_loss(model(idx), targets)
    dispatched = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched.append(func)
            return func(*args, **(kwargs or {}))

    with CPUOffload(0.0, min_bytes=0, force_copy=True) as region:
        pack, unpack = _hooks_top()
        with Record():
            handles = [pack(t) for t in saved]
            [unpack(h) for h in handles]
    assert set(dispatched) <= {torch.ops.aten.detach.default}
    assert region.stats().tensors_saved > 0


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_an_empty_view_of_a_storage_does_not_count(ratio):
    w = torch.randn(64, 8, requires_grad=True)
    x = torch.randn(100, 64)
    with CPUOffload(ratio, min_bytes=0, force_copy=True) as region:
        loss = (x[5:5] @ w).sum() + (torch.empty(0, 64) @ w).sum()  # empty views of a storage and of none
    assert (region.stats().tensors_saved, region.stats().bytes_saved) == (0, 0)
    loss.backward()
