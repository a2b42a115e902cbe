"""Sparsifying codecs and their feedbacks driven as ``hvd_ext.pipeline`` does (compensate ->
prepare_bucket -> compress -> aggregate * scale -> adjust -> update -> commit), N ranks simulated
in one process."""
from hvd_ext.compression._sparse import unpack
from hvd_ext.compression.base import TensorInfo
from hvd_ext.spec import compression_from_spec


def brute_topk(score, k):
    """Reference: sort by (score descending, index ascending), keep k, return ascending indices."""
    s = score.tolist()
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    return sorted(order[:k])


def sim_step(comps, step, grads, params=None, scale=None):
    """One step of N simulated ranks; ``grads[r]`` maps name -> gradient of rank r.

    Returns (applied[r][name], sent[r][name], u[r][name])."""
    n = len(comps)
    scale = 1.0 / n if scale is None else scale
    names = list(grads[0])
    per_rank = []
    for r, c in enumerate(comps):
        fb = c.feedback
        comp_items = []
        for name in names:
            g = grads[r][name]
            info = TensorInfo(name=name, shape=g.shape, step=step, rank=r, size=n,
                              param=None if params is None else params[name])
            info.scale = scale
            comp_items.append((name, info, fb.compensate(name, g.float(), info)))
        if hasattr(c, "prepare_bucket"):
            c.prepare_bucket([(u, info) for _, info, u in comp_items])
        per_rank.append([(name, info, u) + tuple(c.compress(u, info)) for name, info, u in comp_items])
    applied, sents, us = [], [], []
    for r, c in enumerate(comps):
        fb = c.feedback
        a, s, uu = {}, {}, {}
        for j, (name, info, u, payload, ctx) in enumerate(per_rank[r]):
            datas = [per_rank[q][j][3] for q in range(n)]
            res = c.aggregate(datas, ctx, info).mul_(scale)
            sup = c.support(datas, ctx, info) if getattr(fb, "needs_support", False) else None
            res = fb.adjust(name, res, info, sup)
            sent = c.local_contribution(payload, ctx, info, res).reshape(u.shape)
            fb.update(name, u, sent, info)
            a[name], s[name], uu[name] = res.reshape(u.shape).clone(), sent, u
        fb.commit()
        applied.append(a)
        sents.append(s)
        us.append(uu)
    return applied, sents, us


def rank0(res, name="w"):
    """(applied, sent, u) of rank 0 for tensor ``name`` from a sim_step result."""
    return tuple(x[0][name] for x in res)


def make(spec, n=1):
    return [compression_from_spec(spec) for _ in range(n)]


def info_for(t, name="w", step=0, rank=0, size=1, param=None):
    return TensorInfo(name=name, shape=t.shape, step=step, rank=rank, size=size, param=param)


def selected(comp, t, **kw):
    payload, _ = comp.compress(t, info_for(t, **kw))
    idx, val = unpack(payload, t.numel(), comp.value_dtype)
    return idx.tolist(), payload
