"""The router's transfer hint (router/stages/admit_route.transfer_source): which worker a request routed
elsewhere may pull its prefix from."""

from kvmesh.router.stages.admit_route import transfer_source


def test_the_hint_names_the_best_other_holder_only_when_it_holds_more():
    everyone = {"w0", "w1", "w2"}
    assert transfer_source({"w0": 62, "w2": 10}, "w1", everyone) == "w0"
    assert transfer_source({"w0": 62, "w1": 62}, "w1", everyone) is None, "the chosen one has it all"
    assert transfer_source({"w0": 5, "w1": 9}, "w1", everyone) is None
    assert transfer_source({}, "w1", everyone) is None
    assert transfer_source({"w0": 62, "w2": 10}, "w1", {"w1", "w2"}) == "w2", "a failed or excluded holder is skipped"
    assert transfer_source({"w0": 7, "w2": 7}, "w1", everyone) == "w0", "ties: the lower id"
