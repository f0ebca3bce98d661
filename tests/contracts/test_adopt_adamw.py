"""How a third-party optimizer adopts gefen.contracts: ``torch.optim.AdamW`` (spec 40 §9).

This module is the template the gefen-contracts README points to. Adopting takes three steps:

1. Declare the contract with ``gefen.contracts`` only (``adamw_contract`` below): every state
   key, the legal per-parameter key sets ("variants"), and the training combinations, checkpoint
   transports and precisions the optimizer supports. Anything not declared is unsupported.
2. Publish it: add ``optimizer_contract(self) -> OptimizerContract`` to the optimizer
   (``ContractAdamW`` below). It recomputes the contract on every call, mutates nothing, runs no
   collective and never raises on a valid optimizer.
3. Test it with ``gefen.contracts.conformance``: ``check_provider`` (stable, round-tripping
   contract), ``check_state_dict`` (a real ``state_dict()`` matches the declaration) and
   ``check_contract_roundtrip``.

The declaration is deliberately minimal: replicated training only (no sharded layouts).
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from gefen.contracts import (  # noqa: E402  (after the torch skip on purpose)
    CheckpointSupport,
    CheckpointTransport,
    ConformanceError,
    OptimizerCapabilities,
    OptimizerContract,
    OptimizerStateLayout,
    ParameterLayout,
    Precision,
    ProcessGroupScope,
    StateExtent,
    StateField,
    StateGeometry,
    StateScope,
    StateVariant,
    TrainingSupport,
    fingerprint,
)
from gefen.contracts.conformance import (  # noqa: E402
    check_contract_roundtrip,
    check_provider,
    check_state_dict,
)

# The fingerprint pinned by the gefen-contracts golden fixture (tests/test_contracts_primitive.py
# in packages/gefen-contracts): this declaration and that fixture must describe the same contract.
GOLDEN_FINGERPRINT_HEX = "fdd9016be00fdda67aa204ee6651db0f469be8560d6ca9e9413d4d8bf33fd710"


def _per_parameter(name: str, geometry: StateGeometry) -> StateField:
    return StateField(name=name, scope=StateScope.PARAMETER, geometry=geometry, checkpointed=True)


def adamw_contract() -> OptimizerContract:
    """The contract of ``torch.optim.AdamW``, built from ``gefen.contracts`` alone."""
    state_layout = OptimizerStateLayout(
        # Every key AdamW keeps per parameter. It has no optimizer-wide (common) fields.
        fields=[
            _per_parameter("step", StateGeometry.SCALAR),
            _per_parameter("exp_avg", StateGeometry.PARAMETER),
            _per_parameter("exp_avg_sq", StateGeometry.PARAMETER),
            _per_parameter("max_exp_avg_sq", StateGeometry.PARAMETER),
        ],
        # The legal key sets of one state entry: amsgrad adds one moment.
        parameter_variants=[
            StateVariant(
                name="adamw",
                fields=["step", "exp_avg", "exp_avg_sq"],
                layouts={ParameterLayout.REPLICATED},
                extent=StateExtent.GLOBAL_PARAMETER,
            ),
            StateVariant(
                name="adamw_amsgrad",
                fields=["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"],
                layouts={ParameterLayout.REPLICATED},
                extent=StateExtent.GLOBAL_PARAMETER,
            ),
        ],
    )
    capabilities = OptimizerCapabilities(
        training=[
            TrainingSupport(
                layout=ParameterLayout.REPLICATED, process_group_scope=ProcessGroupScope.NONE
            )
        ],
        checkpoints=[
            CheckpointSupport(
                transport=CheckpointTransport.NATIVE_OPTIMIZER,
                same_topology={ParameterLayout.REPLICATED},
                process_group_scope=ProcessGroupScope.NONE,
                requires_collective=False,
                # torch's load_state_dict can fail half-way, so no fail-before-mutation promise.
                atomic_load=False,
            )
        ],
        precisions={Precision.FLOAT32, Precision.BFLOAT16, Precision.FLOAT16, Precision.FLOAT64},
        supported_parameter_ranks=None,  # any ndim
        # Every other flag keeps its default, False: an explicit "unsupported".
    )
    return OptimizerContract(
        implementation="torch.optim.adamw.AdamW",
        state_layout=state_layout,
        capabilities=capabilities,
    )


class ContractAdamW(torch.optim.AdamW):  # type: ignore[misc]
    """AdamW that publishes its contract; nothing else changes."""

    def optimizer_contract(self) -> OptimizerContract:
        # Recomputed on each call from configuration; both variants are declared, so the
        # amsgrad setting needs no special case here.
        return adamw_contract()


def _trained(amsgrad: bool = False, seed: int = 0) -> tuple[torch.nn.Module, ContractAdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    optimizer = ContractAdamW(model.parameters(), lr=1e-2, amsgrad=amsgrad)
    _step(model, optimizer)
    return model, optimizer


def _step(model: torch.nn.Module, optimizer: ContractAdamW) -> None:
    inputs = torch.linspace(-1, 1, 32).reshape(8, 4)
    optimizer.zero_grad()
    model(inputs).pow(2).mean().backward()
    optimizer.step()


def _ndims(optimizer: ContractAdamW) -> dict[int, int]:
    """Per-entry ndim filter, keyed like ``state_dict()["state"]``."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {index: param.ndim for index, param in enumerate(params)}


def test_contract_matches_the_gefen_contracts_golden_fixture() -> None:
    assert fingerprint(adamw_contract().to_primitive()).hex() == GOLDEN_FINGERPRINT_HEX


def test_optimizer_is_a_conforming_provider() -> None:
    _, optimizer = _trained()
    assert check_provider(optimizer) == adamw_contract()


def test_contract_survives_the_round_trip() -> None:
    check_contract_roundtrip(adamw_contract())


@pytest.mark.parametrize(("amsgrad", "variant"), [(False, "adamw"), (True, "adamw_amsgrad")])
def test_state_dict_entries_match_exactly_one_variant(amsgrad: bool, variant: str) -> None:
    _, optimizer = _trained(amsgrad=amsgrad)
    state_dict = optimizer.state_dict()
    result = check_state_dict(optimizer.optimizer_contract(), state_dict, ndims=_ndims(optimizer))
    assert len(result) == 4  # two weights, two biases
    assert set(result.values()) == {(variant,)}


def test_an_extra_key_is_rejected() -> None:
    _, optimizer = _trained()
    state_dict = optimizer.state_dict()
    state_dict["state"][0]["foo"] = torch.zeros(())
    with pytest.raises(ConformanceError, match="undeclared state keys"):
        check_state_dict(optimizer.optimizer_contract(), state_dict)


def test_a_missing_key_is_rejected() -> None:
    _, optimizer = _trained()
    state_dict = optimizer.state_dict()
    del state_dict["state"][0]["exp_avg_sq"]
    with pytest.raises(ConformanceError, match="no state variant"):
        check_state_dict(optimizer.optimizer_contract(), state_dict)


def test_publishing_the_contract_mutates_nothing() -> None:
    """Against an untouched twin: asking for the contract changes no parameter or state bit."""
    model, optimizer = _trained()
    twin_model, twin_optimizer = _trained()
    for _ in range(3):
        optimizer.optimizer_contract()
    _step(model, optimizer)
    _step(twin_model, twin_optimizer)
    for mine, theirs in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    mine_state = copy.deepcopy(optimizer.state_dict())
    their_state = twin_optimizer.state_dict()
    assert mine_state["param_groups"] == their_state["param_groups"]
    for index, entry in mine_state["state"].items():
        assert entry.keys() == their_state["state"][index].keys()
        for key, value in entry.items():
            assert torch.equal(value, their_state["state"][index][key])
