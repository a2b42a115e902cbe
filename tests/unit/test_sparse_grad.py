"""SparseGradients: which gradients are sparse is learnt once per world, as the union over ranks."""
import torch

from hvd_ext.sparse_grad import SparseGradients


class _Ex:
    rank, size = 0, 2


def _params():
    emb, lin = torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 2)
    return emb, lin, [("emb.weight", emb.weight), ("lin.weight", lin.weight), ("lin.bias", lin.bias)]


def test_learns_the_union_over_ranks_and_hands_this_steps_grads_back_sparse():
    emb, lin, params = _params()
    sg = SparseGradients(_Ex(), params, None, as_dense=False, requested_as_dense=False, active=True)
    assert not sg.learnt
    sg.saw("emb.weight", emb.weight.grad)  # no gradient yet: nothing noted
    emb(torch.tensor([[1, 2]])).sum().backward()
    sg.saw("emb.weight", emb.weight.grad)
    sg.saw("lin.weight", torch.zeros(2, 3))  # dense: not noted
    emb.weight.grad = emb.weight.grad.to_dense()  # the pipeline wrote this step's average dense
    other_rank = [("emb.weight", 1)]
    rebuild = sg.learn(lambda mine, name: [mine, other_rank])
    assert rebuild and sg.learnt and sg.owns(emb.weight) and not sg.owns(lin.weight)
    assert emb.weight.grad.is_sparse and [n for n, _, _ in sg.agreed] == ["emb.weight"]
    sg.forget()
    assert not sg.learnt and not sg.owns(emb.weight)


def test_nothing_sparse_anywhere_keeps_the_pipeline():
    _, _, params = _params()
    sg = SparseGradients(_Ex(), params, None, as_dense=False, requested_as_dense=False, active=True)
    assert sg.learn(lambda mine, name: [mine, []]) is False and sg.agreed == []


def test_as_dense_learns_nothing():
    emb, _, params = _params()
    sg = SparseGradients(_Ex(), params, None, as_dense=True, requested_as_dense=True, active=True)
    emb(torch.tensor([[1]])).sum().backward()
    sg.saw("emb.weight", emb.weight.grad)
    assert sg.learnt and not sg.owns(emb.weight)
    sg.forget()
    assert sg.learnt  # a new world: still nothing to learn
