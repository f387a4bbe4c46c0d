from pdserve.worker.cuda_graphs import BUCKETS, graph_buckets


def test_buckets_cover_max_num_seqs_and_no_more():
    assert graph_buckets(1) == (1,)
    assert graph_buckets(3) == (1, 2, 4)
    assert graph_buckets(256) == BUCKETS
    assert graph_buckets(257) == (*BUCKETS, 384)
    assert graph_buckets(512) == (*BUCKETS, 384, 512)
    assert graph_buckets(513) == (*BUCKETS, 384, 512, 640)
    for n in range(1, 1100, 7):
        buckets = graph_buckets(n)
        assert buckets[-1] >= n and (len(buckets) == 1 or buckets[-2] < n)
        assert list(buckets) == sorted(set(buckets))
