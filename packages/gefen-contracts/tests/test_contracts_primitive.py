"""Canonical bytes, fingerprints, golden fixtures and from_primitive errors (spec 40 §7)."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gefen.contracts import (
    ContractTypeError,
    ContractValueError,
    LogicalRegion,
    LogicalSlice,
    OptimizerContract,
    ParameterLayout,
    PrimitiveFormError,
    ShardIdentity,
    ShardingManifest,
    StateScope,
    canonical_bytes,
    fingerprint,
)

# Computed once from conftest.build_adamw_contract() / build_golden_manifest() and pasted here;
# a change to any of these is a change of the wire schema.
ADAMW_CANONICAL_HEX = (
    "7b226361706162696c6974696573223a7b2263616e6f6e6963616c5f706172616d657465725f66716e73223a"
    "66616c73652c22636865636b706f696e7473223a5b7b2261746f6d69635f6c6f6164223a66616c73652c226d"
    "6573685f64696d656e73696f6e73223a6e756c6c2c2270726f636573735f67726f75705f73636f7065223a22"
    "6e6f6e65222c2272657175697265645f736861726465645f6d6f646573223a5b5d2c2272657175697265735f"
    "636f6c6c656374697665223a66616c73652c2273616d655f746f706f6c6f6779223a5b227265706c69636174"
    "6564225d2c22746f706f6c6f67795f6368616e67655f6b696e6473223a5b5d2c22746f706f6c6f67795f6368"
    "616e67696e67223a5b5d2c227472616e73706f7274223a226e61746976655f6f7074696d697a6572227d5d2c"
    "226578706c696369745f70726f636573735f67726f75705f636f6465626f6f6b5f73636f7065223a66616c73"
    "652c22706f73745f7368617264696e67223a66616c73652c22707265636973696f6e73223a5b2262666c6f61"
    "743136222c22666c6f61743136222c22666c6f61743332222c22666c6f61743634225d2c2273686172645f72"
    "6562696e64696e67223a66616c73652c22737461626c655f73686172645f6964656e74697479223a66616c73"
    "652c22737570706f727465645f706172616d657465725f72616e6b73223a6e756c6c2c22747261696e696e67"
    "223a5b7b226c61796f7574223a227265706c696361746564222c226d6573685f64696d656e73696f6e73223a"
    "6e756c6c2c2270726f636573735f67726f75705f73636f7065223a226e6f6e65222c2272657175697265735f"
    "636f6d706c6574655f6c6f676963616c5f6d6174726978223a66616c73652c2272657175697265735f636f6d"
    "706c6574655f706172616d657465725f73746f72616765223a66616c73652c2272657175697265735f706f73"
    "745f737465705f706172616d657465725f73796e63223a66616c73652c22736861726465645f6d6f6465223a"
    "6e756c6c7d5d7d2c226368696c6472656e223a5b5d2c22696d706c656d656e746174696f6e223a22746f7263"
    "682e6f7074696d2e6164616d772e4164616d57222c22736368656d615f76657273696f6e223a312c22737461"
    "74655f6c61796f7574223a7b22636f6d706f736974655f6e616d65737061636573223a5b5d2c226669656c64"
    "73223a5b7b226170706c696361626c655f736861726465645f6d6f646573223a5b5d2c22636865636b706f69"
    "6e746564223a747275652c226465736372697074696f6e223a22222c2267656f6d65747279223a227363616c"
    "6172222c226b65795f6d61746368223a226578616374222c226e616d65223a2273746570222c226f7074696f"
    "6e616c223a66616c73652c2273636f7065223a22706172616d65746572227d2c7b226170706c696361626c65"
    "5f736861726465645f6d6f646573223a5b5d2c22636865636b706f696e746564223a747275652c2264657363"
    "72697074696f6e223a22222c2267656f6d65747279223a22706172616d65746572222c226b65795f6d617463"
    "68223a226578616374222c226e616d65223a226578705f617667222c226f7074696f6e616c223a66616c7365"
    "2c2273636f7065223a22706172616d65746572227d2c7b226170706c696361626c655f736861726465645f6d"
    "6f646573223a5b5d2c22636865636b706f696e746564223a747275652c226465736372697074696f6e223a22"
    "222c2267656f6d65747279223a22706172616d65746572222c226b65795f6d61746368223a22657861637422"
    "2c226e616d65223a226578705f6176675f7371222c226f7074696f6e616c223a66616c73652c2273636f7065"
    "223a22706172616d65746572227d2c7b226170706c696361626c655f736861726465645f6d6f646573223a5b"
    "5d2c22636865636b706f696e746564223a747275652c226465736372697074696f6e223a22222c2267656f6d"
    "65747279223a22706172616d65746572222c226b65795f6d61746368223a226578616374222c226e616d6522"
    "3a226d61785f6578705f6176675f7371222c226f7074696f6e616c223a66616c73652c2273636f7065223a22"
    "706172616d65746572227d5d2c22706172616d657465725f76617269616e7473223a5b7b226170706c696573"
    "5f746f5f6c61796f757473223a6e756c6c2c226465736372697074696f6e223a22222c226578636c75646564"
    "5f706172616d657465725f72616e6b73223a5b5d2c22657874656e74223a22676c6f62616c5f706172616d65"
    "746572222c226669656c6473223a5b2273746570222c226578705f617667222c226578705f6176675f737122"
    "5d2c22696e6163746976655f6669656c6473223a5b5d2c22696e697469616c697a6564223a747275652c226c"
    "61796f757473223a5b227265706c696361746564225d2c226d6967726174696f6e5f6f6e6c79223a66616c73"
    "652c226e616d65223a226164616d77222c22706172616d657465725f72616e6b73223a6e756c6c2c22726f6c"
    "65223a22616e79222c22736861726465645f6d6f6465223a6e756c6c7d2c7b226170706c6965735f746f5f6c"
    "61796f757473223a6e756c6c2c226465736372697074696f6e223a22222c226578636c756465645f70617261"
    "6d657465725f72616e6b73223a5b5d2c22657874656e74223a22676c6f62616c5f706172616d65746572222c"
    "226669656c6473223a5b2273746570222c226578705f617667222c226578705f6176675f7371222c226d6178"
    "5f6578705f6176675f7371225d2c22696e6163746976655f6669656c6473223a5b5d2c22696e697469616c69"
    "7a6564223a747275652c226c61796f757473223a5b227265706c696361746564225d2c226d6967726174696f"
    "6e5f6f6e6c79223a66616c73652c226e616d65223a226164616d775f616d7367726164222c22706172616d65"
    "7465725f72616e6b73223a6e756c6c2c22726f6c65223a22616e79222c22736861726465645f6d6f6465223a"
    "6e756c6c7d5d7d7d"
)
ADAMW_FINGERPRINT_HEX = "fdd9016be00fdda67aa204ee6651db0f469be8560d6ca9e9413d4d8bf33fd710"
MANIFEST_CANONICAL_HEX = (
    "7b22736368656d615f76657273696f6e223a312c22736861726473223a5b7b22657874656e74223a7b22666c"
    "61745f6f6666736574223a302c226b696e64223a226c6f676963616c5f736c696365222c226c656e67746822"
    "3a347d2c226c61796f7574223a227265706c696361746564222c226c6f63616c5f6d656d626572223a6e756c"
    "6c2c226f776e6572223a6e756c6c2c22706172616d65746572223a7b2266716e223a226c617965722e626961"
    "73222c22676c6f62616c5f7368617065223a5b345d2c22736368656d615f76657273696f6e223a317d2c2270"
    "6c6163656d656e7473223a5b5d2c2270726f636573735f67726f7570223a6e756c6c2c22736368656d615f76"
    "657273696f6e223a317d2c7b22657874656e74223a7b22666c61745f6f6666736574223a302c226b696e6422"
    "3a226c6f676963616c5f736c696365222c226c656e677468223a347d2c226c61796f7574223a22666c617474"
    "656e65645f656c656d656e745f7368617264222c226c6f63616c5f6d656d626572223a2272616e6b3a30222c"
    "226f776e6572223a6e756c6c2c22706172616d65746572223a7b2266716e223a226c617965722e7765696768"
    "74222c22676c6f62616c5f7368617065223a5b322c345d2c22736368656d615f76657273696f6e223a317d2c"
    "22706c6163656d656e7473223a5b7b22636f6f7264696e617465223a302c226b696e64223a22666c61745f73"
    "68617264222c226d6573685f61786973223a22646174615f706172616c6c656c222c22706172616d65746572"
    "5f64696d656e73696f6e223a6e756c6c2c227061727473223a327d5d2c2270726f636573735f67726f757022"
    "3a7b226f7264657265645f6d656d62657273223a5b2272616e6b3a30222c2272616e6b3a31225d2c22736368"
    "656d615f76657273696f6e223a312c2273656d616e7469635f6e616d65223a226470227d2c22736368656d61"
    "5f76657273696f6e223a317d2c7b22657874656e74223a7b22666c61745f6f6666736574223a342c226b696e"
    "64223a226c6f676963616c5f736c696365222c226c656e677468223a347d2c226c61796f7574223a22666c61"
    "7474656e65645f656c656d656e745f7368617264222c226c6f63616c5f6d656d626572223a2272616e6b3a31"
    "222c226f776e6572223a6e756c6c2c22706172616d65746572223a7b2266716e223a226c617965722e776569"
    "676874222c22676c6f62616c5f7368617065223a5b322c345d2c22736368656d615f76657273696f6e223a31"
    "7d2c22706c6163656d656e7473223a5b7b22636f6f7264696e617465223a312c226b696e64223a22666c6174"
    "5f7368617264222c226d6573685f61786973223a22646174615f706172616c6c656c222c22706172616d6574"
    "65725f64696d656e73696f6e223a6e756c6c2c227061727473223a327d5d2c2270726f636573735f67726f75"
    "70223a7b226f7264657265645f6d656d62657273223a5b2272616e6b3a30222c2272616e6b3a31225d2c2273"
    "6368656d615f76657273696f6e223a312c2273656d616e7469635f6e616d65223a226470227d2c2273636865"
    "6d615f76657273696f6e223a317d5d7d"
)
MANIFEST_FINGERPRINT_HEX = "5967f8d215a9b3a1d17d54e52d32d8e7f653190cbd207bcf5fb532da6370b78f"

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")


class TestCanonicalBytes:
    def test_is_sorted_compact_utf8_json(self) -> None:
        obj = {"b": [1, 2.5, None, True], "a": {"é": "ü"}}
        expected = '{"a":{"é":"ü"},"b":[1,2.5,null,true]}'.encode()
        assert canonical_bytes(obj) == expected
        assert json.loads(canonical_bytes(obj)) == obj

    def test_key_order_of_the_input_does_not_matter(self) -> None:
        assert canonical_bytes({"a": 1, "b": 2}) == canonical_bytes({"b": 2, "a": 1})

    @pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
    def test_rejects_non_finite_floats(self, value: float) -> None:
        with pytest.raises(ContractValueError, match="finite"):
            canonical_bytes({"x": [value]})

    @pytest.mark.parametrize(
        "value",
        [
            (1, 2),
            {1, 2},
            frozenset(),
            b"x",
            StateScope.PARAMETER,
            collections.OrderedDict(),
            object(),
        ],
        ids=["tuple", "set", "frozenset", "bytes", "enum-member", "dict-subclass", "object"],
    )
    def test_rejects_non_primitive_types(self, value: object) -> None:
        with pytest.raises(ContractTypeError, match=r"^canonical_bytes\.obj\['x'\] must be"):
            canonical_bytes({"x": value})

    def test_rejects_non_str_keys(self) -> None:
        with pytest.raises(ContractTypeError, match="dict keys must be str"):
            canonical_bytes({1: "x"})
        with pytest.raises(ContractTypeError, match="dict keys must be str"):
            canonical_bytes({StateScope.PARAMETER: "x"})

    def test_lone_surrogate_is_a_contract_value_error(self) -> None:
        for obj in ("\ud800", {"\ud800": 1}, ["ok", "a\udfffb"]):
            with pytest.raises(ContractValueError, match="UTF-8") as caught:
                canonical_bytes(obj)
            assert not isinstance(caught.value, UnicodeError)

    def test_depth_limit_is_64(self) -> None:
        def nest(depth: int) -> Any:
            obj: Any = 0
            for _ in range(depth):
                obj = [obj]
            return obj

        assert canonical_bytes(nest(64)) == b"[" * 64 + b"0" + b"]" * 64
        with pytest.raises(ContractValueError, match="deeper than 64"):
            canonical_bytes(nest(65))
        cycle: list[object] = []
        cycle.append(cycle)
        with pytest.raises(ContractValueError, match="deeper than 64"):
            canonical_bytes(cycle)

    def test_scalars(self) -> None:
        assert canonical_bytes(None) == b"null"
        assert canonical_bytes(True) == b"true"
        assert canonical_bytes(-3) == b"-3"
        assert canonical_bytes('a"b') == b'"a\\"b"'

    def test_fingerprint_is_sha256_of_canonical_bytes(self) -> None:
        obj = {"k": ["v", 1]}
        assert fingerprint(obj) == hashlib.sha256(canonical_bytes(obj)).digest()
        assert len(fingerprint(obj)) == 32
        with pytest.raises(ContractTypeError):
            fingerprint((1,))


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=80, deadline=None)
@given(_JSON)
def test_property_canonical_bytes_round_trips_json_values(value: object) -> None:
    encoded = canonical_bytes(value)
    assert json.loads(encoded.decode("utf-8")) == value
    assert canonical_bytes(json.loads(encoded)) == encoded


class TestGoldenFixtures:
    def test_adamw_contract(self, adamw_contract: OptimizerContract) -> None:
        primitive = adamw_contract.to_primitive()
        assert canonical_bytes(primitive).hex() == "".join(ADAMW_CANONICAL_HEX)
        assert fingerprint(primitive).hex() == ADAMW_FINGERPRINT_HEX

    def test_manifest(self, golden_manifest: ShardingManifest) -> None:
        primitive = golden_manifest.to_primitive()
        assert canonical_bytes(primitive).hex() == "".join(MANIFEST_CANONICAL_HEX)
        assert fingerprint(primitive).hex() == MANIFEST_FINGERPRINT_HEX

    def test_golden_bytes_parse_back_to_the_values(
        self, adamw_contract: OptimizerContract, golden_manifest: ShardingManifest
    ) -> None:
        adamw = json.loads(bytes.fromhex("".join(ADAMW_CANONICAL_HEX)))
        manifest = json.loads(bytes.fromhex("".join(MANIFEST_CANONICAL_HEX)))
        assert OptimizerContract.from_primitive(adamw) == adamw_contract
        assert ShardingManifest.from_primitive(manifest) == golden_manifest

    @pytest.mark.parametrize("seed", ["0", "4242"])
    def test_reproduced_in_a_fresh_process_with_another_hash_seed(self, seed: str) -> None:
        script = (
            "import runpy, sys\n"
            "from gefen.contracts import canonical_bytes, fingerprint\n"
            "builders = runpy.run_path(sys.argv[1])\n"
            "for name in ('build_adamw_contract', 'build_golden_manifest'):\n"
            "    primitive = builders[name]().to_primitive()\n"
            "    print(canonical_bytes(primitive).hex(), fingerprint(primitive).hex())\n"
        )
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", script, str(CONFTEST)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            timeout=120,
        )
        lines = [line.split() for line in result.stdout.splitlines()]
        assert lines == [
            ["".join(ADAMW_CANONICAL_HEX), ADAMW_FINGERPRINT_HEX],
            ["".join(MANIFEST_CANONICAL_HEX), MANIFEST_FINGERPRINT_HEX],
        ]


def _form_error(value_type: type, primitive: object, path: str) -> PrimitiveFormError:
    with pytest.raises(PrimitiveFormError) as caught:
        value_type.from_primitive(primitive)
    message = str(caught.value)
    assert message.startswith(path), message
    return caught.value


class TestFromPrimitiveErrors:
    """One case per bullet of spec 40 §7.2, plus the §12 list."""

    @pytest.fixture
    def primitive(self, adamw_contract: OptimizerContract) -> dict[str, Any]:
        return adamw_contract.to_primitive()

    def test_accepts_its_own_primitive(
        self, primitive: dict[str, Any], adamw_contract: OptimizerContract
    ) -> None:
        assert OptimizerContract.from_primitive(primitive) == adamw_contract

    def test_non_dict_where_an_object_is_expected(self, primitive: dict[str, Any]) -> None:
        _form_error(OptimizerContract, [], "OptimizerContract: must be a dict")
        primitive["capabilities"]["training"][0] = ["replicated", "none"]
        _form_error(OptimizerContract, primitive, "OptimizerContract.capabilities.training[0]: ")

    def test_dict_subclass_is_not_a_dict(self, primitive: dict[str, Any]) -> None:
        _form_error(OptimizerContract, collections.OrderedDict(primitive), "OptimizerContract: ")
        layout = primitive["state_layout"]
        primitive["state_layout"] = collections.OrderedDict(layout)
        _form_error(OptimizerContract, primitive, "OptimizerContract.state_layout: must be a dict")

    def test_missing_key(self, primitive: dict[str, Any]) -> None:
        del primitive["capabilities"]["post_sharding"]
        error = _form_error(OptimizerContract, primitive, "OptimizerContract.capabilities: ")
        assert "missing key 'post_sharding'" in str(error)

    def test_extra_key(self, primitive: dict[str, Any]) -> None:
        primitive["state_layout"]["fields"][1]["extra"] = 1
        error = _form_error(
            OptimizerContract, primitive, "OptimizerContract.state_layout.fields[1]: "
        )
        assert "unexpected key 'extra'" in str(error)

    def test_tuple_where_a_list_is_expected(self, primitive: dict[str, Any]) -> None:
        primitive["capabilities"]["training"] = tuple(primitive["capabilities"]["training"])
        _form_error(
            OptimizerContract, primitive, "OptimizerContract.capabilities.training: must be a list"
        )

    def test_bool_for_int_and_int_for_bool(self, primitive: dict[str, Any]) -> None:
        primitive["schema_version"] = True
        _form_error(
            OptimizerContract, primitive, "OptimizerContract.schema_version: must be an int"
        )
        primitive["schema_version"] = 1
        primitive["capabilities"]["post_sharding"] = 1
        _form_error(
            OptimizerContract,
            primitive,
            "OptimizerContract.capabilities.post_sharding: must be a bool",
        )

    def test_unknown_enum_value(self, primitive: dict[str, Any]) -> None:
        primitive["capabilities"]["training"][0]["layout"] = "REPLICATED"
        error = _form_error(
            OptimizerContract, primitive, "OptimizerContract.capabilities.training[0].layout: "
        )
        assert "unknown ParameterLayout value 'REPLICATED'" in str(error)

    def test_wrong_kind_tag(self, golden_manifest: ShardingManifest) -> None:
        slice_primitive = LogicalSlice(0, 1).to_primitive()
        _form_error(
            LogicalSlice,
            {**slice_primitive, "kind": "logical_region"},
            "LogicalSlice.kind: wrong kind tag",
        )
        _form_error(
            LogicalRegion,
            {"kind": 1, "offsets": [], "lengths": []},
            "LogicalRegion.kind: wrong kind tag",
        )
        primitive = golden_manifest.to_primitive()
        primitive["shards"][0]["extent"]["kind"] = "logical_box"
        _form_error(
            ShardingManifest, primitive, "ShardingManifest.shards[0].extent.kind: wrong kind tag"
        )
        del primitive["shards"][0]["extent"]["kind"]
        _form_error(
            ShardingManifest, primitive, "ShardingManifest.shards[0].extent.kind: wrong kind tag"
        )

    def test_duplicate_elements_in_a_set_valued_list(self, primitive: dict[str, Any]) -> None:
        primitive["capabilities"]["precisions"] = ["float32", "float32"]
        error = _form_error(
            OptimizerContract, primitive, "OptimizerContract.capabilities.precisions[1]: "
        )
        assert "duplicate" in str(error)

    def test_constructor_error_is_chained_at_the_objects_path(
        self, primitive: dict[str, Any]
    ) -> None:
        primitive["capabilities"]["training"][0]["mesh_dimensions"] = [0]
        error = _form_error(
            OptimizerContract, primitive, "OptimizerContract.capabilities.training[0]: "
        )
        original = error.__cause__
        assert type(original) is ContractValueError
        assert str(error) == f"OptimizerContract.capabilities.training[0]: {original}"
        assert str(original).startswith("TrainingSupport.mesh_dimensions[0]: must be >= 1")

    def test_cross_field_constructor_error_is_wrapped_too(
        self, golden_manifest: ShardingManifest
    ) -> None:
        primitive = golden_manifest.to_primitive()
        primitive["shards"][1]["extent"]["length"] = 3
        error = _form_error(
            ShardingManifest, primitive, "ShardingManifest: ShardingManifest.shards["
        )
        assert isinstance(error.__cause__, ContractValueError)
        assert "gapless" in str(error)

    def test_type_error_from_a_constructor_becomes_a_form_error(
        self, golden_manifest: ShardingManifest
    ) -> None:
        primitive = golden_manifest.to_primitive()
        primitive["shards"][1]["layout"] = ParameterLayout.DTENSOR_1D_DEFAULT_WORLD.value
        error = _form_error(
            ShardingManifest, primitive, "ShardingManifest.shards[1]: ShardIdentity.extent"
        )
        assert type(error.__cause__) is ContractTypeError

    def test_name_rules_rerun(self, primitive: dict[str, Any]) -> None:
        primitive["implementation"] = " torch"
        error = _form_error(
            OptimizerContract, primitive, "OptimizerContract: OptimizerContract.implementation"
        )
        assert "whitespace" in str(error)

    def test_shard_identity_from_primitive(self, golden_manifest: ShardingManifest) -> None:
        shard = golden_manifest.shards[0]
        assert ShardIdentity.from_primitive(shard.to_primitive()) == shard
        _form_error(
            ShardIdentity,
            {**shard.to_primitive(), "owner": 5},
            "ShardIdentity.owner: must be a str",
        )
