"""The distribution installs as its own subpackage of the ``gefen`` namespace."""

from __future__ import annotations

import importlib.metadata
import pathlib

import gefen.dist
import gefen.dist.testing


def test_version_matches_distribution_metadata() -> None:
    assert gefen.dist.__version__ == importlib.metadata.version("gefen-dist")


def test_ships_py_typed() -> None:
    package_dir = pathlib.Path(gefen.dist.__file__).parent
    assert (package_dir / "py.typed").is_file()


def test_every_public_name_resolves() -> None:
    for module in (gefen.dist, gefen.dist.testing):
        assert len(module.__all__) == len(set(module.__all__))
        for name in module.__all__:
            assert getattr(module, name) is not None, name


def test_the_spec_names_are_exported() -> None:
    expected = {
        "backend_allows",
        "choose_collective_device",
        "mesh_key",
        "Channel",
        "collect_failure_scope",
        "cuda_graph_capturing",
        "collective",
        "synchronize_step_error",
        "prepare_synchronized_amp_step",
        "ProcessGroupBinding",
        "CodebookProcessGroupBinding",
        "CheckpointProcessGroupBinding",
        "GuardedOperation",
        "TransportLimits",
        "broadcast_owner_state",
        "all_gather_records",
        "rank_local_header",
        "check_rank_local_records",
        "DistributedStepError",
        "GroupAgreementError",
        "BindingError",
    }
    assert expected <= set(gefen.dist.__all__)
    assert {"run_ranks", "mark", "rank_device", "timed", "gloo_required"} <= set(
        gefen.dist.testing.__all__
    )
    assert {"deep_snapshot", "snapshot_diff", "assert_unchanged"} <= set(gefen.dist.testing.__all__)


def test_error_types_have_the_specified_bases() -> None:
    assert issubclass(gefen.dist.DistributedStepError, RuntimeError)
    assert issubclass(gefen.dist.GroupAgreementError, RuntimeError)
    assert issubclass(gefen.dist.BindingError, ValueError)
    assert issubclass(gefen.dist.testing.RankFailure, AssertionError)
    assert issubclass(gefen.dist.testing.RankTimeout, gefen.dist.testing.RankFailure)


def test_voted_errors_survive_pickling() -> None:
    import pickle

    error = gefen.dist.DistributedStepError(
        "Gefen step preflight failed on local rank 0: x",
        owner_name="Gefen",
        phase="step preflight",
        local_failure=True,
        rank=0,
    )
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.owner_name, copy.phase, copy.local_failure, copy.rank) == (
        str(error),
        "Gefen",
        "step preflight",
        True,
        0,
    )
    agreement = gefen.dist.GroupAgreementError("m", owner_name="Gefen", what="header")
    assert pickle.loads(pickle.dumps(agreement)).what == "header"
