"""sample(): greedy exactness, per-request seeds independent of the batch, top-k / top-p cuts."""
import torch

from pdserve.model.sampler import Sampler, sample, skip_draws

VOCAB = 1000


def random_logits(num_rows, seed=0):
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_exact_argmax():
    logits = random_logits(6)
    expected = logits.argmax(-1)
    assert torch.equal(sample(logits, [0.0] * 6, [1.0] * 6, [0] * 6, [None] * 6), expected)
    # as tensors (no host shortcut) and with top-k/top-p set: greedy rows ignore them
    got = sample(logits, torch.zeros(6), torch.full((6,), 0.5), torch.full((6,), 3), [None] * 6)
    assert torch.equal(got, expected)


def test_greedy_rows_stay_exact_in_a_sampled_batch():
    logits = random_logits(8, seed=1)
    temperatures = [0.0, 1.0, 0.0, 0.7, 0.0, 1.5, 0.0, 1.0]
    got = sample(logits, temperatures, [1.0] * 8, [0] * 8, [None] * 8)
    greedy_rows = [i for i, t in enumerate(temperatures) if t == 0]
    assert torch.equal(got[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_seeded_request_is_reproducible_whatever_the_batch():
    row = random_logits(1, seed=2)[0]
    alone_draws = []
    generator = seeded(123)
    for _ in range(10):  # ten steps of one request
        alone_draws.append(int(sample(row[None], [1.0], [1.0], [0], [generator])[0]))
    batch_draws = []
    generator = seeded(123)
    others = random_logits(4, seed=3)
    for step in range(10):  # the same request at row 2, among seeded and unseeded neighbours
        logits = torch.cat([others[:2], row[None], others[2:]])
        got = sample(logits, [1.0, 0.8, 1.0, 0.0, 1.2], [1.0, 0.9, 1.0, 1.0, 1.0], [0, 5, 0, 0, 0],
                     [seeded(step), None, generator, None, seeded(99)])
        batch_draws.append(int(got[2]))
    assert alone_draws == batch_draws
    assert len(set(alone_draws)) > 1  # really sampling, not stuck on the argmax


def test_tensor_and_list_inputs_agree():
    logits = random_logits(3, seed=4)
    as_lists = sample(logits, [0.9, 1.0, 0.0], [0.8, 1.0, 1.0], [10, 0, 0], [seeded(1), seeded(2), seeded(3)])
    as_tensors = Sampler()(logits, torch.tensor([0.9, 1.0, 0.0]), torch.tensor([0.8, 1.0, 1.0]),
                           torch.tensor([10, 0, 0]), [seeded(1), seeded(2), seeded(3)])
    assert torch.equal(as_lists, as_tensors)


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = random_logits(64, seed=5)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, [1.0] * 64, [1.0] * 64, [1] * 64, [None] * 64), greedy)
    assert torch.equal(sample(logits, [1.0] * 64, [1e-6] * 64, [0] * 64, [None] * 64), greedy)


def test_sampling_follows_the_cut_distribution():
    num_rows = 4000
    base = torch.full((VOCAB,), -1e4)
    base[:4] = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    logits = base.repeat(num_rows, 1)
    counts = torch.bincount(sample(logits, [1.0] * num_rows, [1.0] * num_rows, [0] * num_rows,
                                   [None] * num_rows), minlength=VOCAB).float() / num_rows
    torch.testing.assert_close(counts[:4], torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    top_k_2 = sample(logits, [1.0] * num_rows, [1.0] * num_rows, [2] * num_rows, [None] * num_rows)
    assert set(top_k_2.tolist()) == {0, 1}
    assert abs((top_k_2 == 0).float().mean().item() - 0.625) < 0.03  # 0.5 / (0.5 + 0.3)
    top_p = sample(logits, [1.0] * num_rows, [0.75] * num_rows, [0] * num_rows, [None] * num_rows)
    assert set(top_p.tolist()) == {0, 1}  # 0.5 + 0.3 is the smallest set holding 0.75


def test_skip_draws_continues_a_seeded_stream_where_another_instance_stopped():
    """A request resumed after k tokens: its generator, fast-forwarded by k draws, samples the tokens
    the uninterrupted run sampled next, on the plain temperature path and on the top-k / top-p path
    (each draws the same noise per step), alone or among other rows."""
    steps = [random_logits(1, seed=10 + i)[0] for i in range(12)]
    others = random_logits(3, seed=50)
    for temperature, top_p, top_k in ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 20), (0.8, 0.5, 7)):
        def run(generator, rows, in_batch):
            tokens = []
            for row in rows:
                if in_batch:   # among an unseeded, a greedy and another seeded row
                    logits = torch.cat([others[:1], row[None], others[1:]])
                    got = sample(logits, [1.0, temperature, 0.0, 0.9], [1.0, top_p, 1.0, 0.8], [0, top_k, 0, 3],
                                 [None, generator, None, seeded(5)])[1]
                else:
                    got = sample(row[None], [temperature], [top_p], [top_k], [generator])[0]
                tokens.append(int(got))
            return tokens
        whole = run(seeded(77), steps, in_batch=False)
        assert len(set(whole)) > 1
        for k in (1, 5, 11):
            generator = seeded(77)
            skip_draws(generator, VOCAB, k, torch.device("cpu"))
            assert run(generator, steps[k:], in_batch=k % 2 == 1) == whole[k:], (temperature, top_p, top_k, k)
