"""The layering contracts of pyproject.toml (checked in CI by `lint-imports`) hold, each one breaks
on an import that crosses it, and the imports they ignore exist for annotations only."""

import tomllib
from copy import deepcopy

import grimp
import pytest
from helpers import ROOT
from importlinter.configuration import configure
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract

configure()  # what `lint-imports` sets up before checking: the timer a check reads

PYPROJECT = ROOT / "pyproject.toml"
SECTION = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
CONTRACTS = {options["id"]: options for options in SECTION["contracts"]}
SESSION = {
    "root_packages": [SECTION["root_package"]],
    "include_external_packages": SECTION["include_external_packages"],
}

# For each contract, one import that must break it. The workers' one is indirect: a worker reaches
# the controller through the shared types module.
PLANTED = {
    "layers": ("asyncrl.control.controller", "asyncrl.run"),
    "workers": ("asyncrl.types", "asyncrl.control.controller"),
    "control-side": ("asyncrl.control.weight_sync", "asyncrl.models.tiny"),
    "gate": ("asyncrl.control.gate", "asyncrl.control.weight_sync"),
    "integrity": ("asyncrl.integrity.sync_checks", "asyncrl.control.handles"),
    "weights": ("asyncrl.weights.size", "asyncrl.types"),
    "torch-free": ("asyncrl.control.sampler", "torch"),
    "payloads": ("asyncrl.runtime.payloads", "asyncrl.trainer.worker"),
    "grpo": ("asyncrl.algorithms.grpo", "asyncrl.models.logprobs"),
    "models": ("asyncrl.models.logprobs", "asyncrl.algorithms.grpo"),
    "pretrained": ("asyncrl.pretrained.gguf", "asyncrl.trainer.worker"),
}


def build_graph(**options) -> grimp.ImportGraph:
    return grimp.build_graph(SECTION["root_package"], include_external_packages=True, cache_dir=None, **options)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return build_graph()


def check(contract_id: str, graph: grimp.ImportGraph) -> bool:
    options = CONTRACTS[contract_id]
    kind = {"forbidden": ForbiddenContract, "layers": LayersContract}[options["type"]]
    contract = kind(name=options["name"], session_options=SESSION, contract_options=options)
    return contract.check(deepcopy(graph), verbose=False).kept  # a check removes its ignored imports


def test_every_contract_has_a_planted_violation():
    assert set(CONTRACTS) == set(PLANTED)


@pytest.mark.parametrize("contract_id", PLANTED)
def test_a_contract_holds_and_breaks_on_a_planted_import(graph, contract_id):
    assert check(contract_id, graph)
    planted = deepcopy(graph)
    importer, imported = PLANTED[contract_id]
    planted.add_import(importer=importer, imported=imported)
    assert not check(contract_id, planted)


def test_the_weights_contract_forbids_every_other_module_of_asyncrl():
    """weights/ may import nothing of asyncrl outside itself: a new top-level module is on the list too."""
    package = ROOT / "asyncrl"
    modules = {f"asyncrl.{path.stem}" for path in package.glob("*.py") if path.stem != "__init__"}
    modules |= {f"asyncrl.{path.parent.name}" for path in package.glob("*/__init__.py")}
    assert set(CONTRACTS["weights"]["forbidden_modules"]) == modules - {"asyncrl.weights", "asyncrl.__main__"}


def test_the_ignored_imports_are_for_annotations_only():
    """An import a contract ignores must sit under TYPE_CHECKING: at run time it does not happen."""
    ignored = [line for options in SECTION["contracts"] for line in options.get("ignore_imports", [])]
    assert ignored
    runtime = build_graph(exclude_type_checking_imports=True)
    for line in ignored:
        importer, imported = (name.strip() for name in line.split("->"))
        assert not runtime.direct_import_exists(importer=importer, imported=imported), line
