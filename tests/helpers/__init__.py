"""Helpers shared by several test modules, each written once (fixtures and the multi-rank launcher
are in tests/conftest.py):

simgrads  gradient sets for simulated-world tests and their reference mean
auto      gradients and a scripted link probe for compression="auto"
codecs    a TensorInfo for single-process codec and feedback tests (size 2)
quant     quantizing codecs in one process: TensorInfo, one round trip, a heavy-tailed gradient
sparse    sparsifying codecs and feedbacks driven as the pipeline does, N ranks in one process
nodes     a stand-in Exchange laid out on nodes, for the route choice
checks    the named in-process checks multi-rank workers report, asserted by name (assert_checks)
"""
