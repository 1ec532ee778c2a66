"""The check that keeps the packages' imports pointing one way (`scripts/check_layers.py`, run by
`scripts/dev check`): the project passes it, and it finds an import from a layer above, a circle of
type-only imports, a dialect importing another, a package importing one it may not (the store's read contract
importing any other, what trains or the trainers' client importing the gateway), the serving path reading what
trains, and shipped code needing the testbed."""

from __future__ import annotations

from pathlib import Path

from support.modules import ROOT, script

check = script("check_layers")


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in (*check.PACKAGES, "testbed"):
        (root / package).mkdir(exist_ok=True)
        for folder in [root / package, *(p for p in (root / package).rglob("*") if p.is_dir())]:
            (folder / "__init__.py").touch()
    return root


def test_the_projects_imports_point_one_way():
    assert list(check.findings(ROOT)) == []


def test_an_import_from_a_layer_above_is_found(tmp_path):
    root = tree(
        tmp_path,
        {
            "gateway/store/rows.py": "from gateway.turns.forward import forward\n",
            "gateway/turns/forward.py": "",
        },
    )

    assert list(check.findings(root)) == [
        "gateway.store.rows imports gateway.turns.forward, which is in a layer above it"
    ]


def test_a_circle_of_type_only_imports_is_found(tmp_path):
    only_types = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.fleet.{} import X\n"
    root = tree(
        tmp_path,
        {
            "gateway/fleet/pool.py": only_types.format("health"),
            "gateway/fleet/health.py": only_types.format("pool"),
        },
    )

    assert list(check.findings(root)) == ["a circle of 2 modules: gateway.fleet.health, gateway.fleet.pool"]


def test_a_dialect_importing_another_is_found_and_one_importing_its_own_modules_is_not(tmp_path):
    root = tree(
        tmp_path,
        {
            "gateway/anthropic/router.py": "from gateway.openai.router import read_call\n"
            "from gateway.anthropic.translate import to_chat\n",
            "gateway/anthropic/translate.py": "",
            "gateway/responses/protocol.py": "from gateway.openai import protocol\n",
            "gateway/openai/router.py": "",
            "gateway/openai/protocol.py": "",
        },
    )

    assert list(check.findings(root)) == [
        "gateway.anthropic.router imports gateway.openai.router: a dialect never imports another one",
        "gateway.responses.protocol imports gateway.openai.protocol: a dialect never imports another one",
    ]


def test_a_package_importing_one_it_may_not_and_the_serving_path_reading_what_trains_are_found(tmp_path):
    root = tree(
        tmp_path,
        {
            "rollout_store/schema.py": "from gateway.settings import Settings\n",
            "rollout_store/delta.py": "from rollout_store.tokens import unpack_ids\n"
            "import training_data.groups\n",
            "rollout_store/tokens.py": "",
            "trainer_client/client.py": "import rollout_store.schema\nfrom gateway.fleet import pool\n",
            "trainer_client/batch.py": "from training_data.samples import Sample\n",
            "training_data/samples.py": "",
            "training_data/groups.py": "from rollout_store import schema\n"
            "from gateway.store.writer import W\nimport trainer_client.client\n",
            "gateway/settings.py": "",
            "gateway/store/writer.py": "from rollout_store.schema import turns\n",
            "gateway/fleet/pool.py": "",
            "gateway/turns/forward.py": "import trainer_client.client\nfrom training_data import groups\n",
            "gateway/ui/queries.py": "from training_data.groups import read_groups\n",
        },
    )

    assert list(check.findings(root)) == [
        "gateway.turns.forward imports trainer_client.client: gateway imports only rollout_store and "
        "training_data of the other packages",
        "gateway.turns.forward imports training_data.groups: of the gateway, only the viewer reads what "
        "trains",
        "rollout_store.delta imports training_data.groups: rollout_store imports none of the other packages",
        "rollout_store.schema imports gateway.settings: rollout_store imports none of the other packages",
        "trainer_client.client imports gateway.fleet.pool: trainer_client imports only rollout_store and "
        "training_data of the other packages",
        "training_data.groups imports gateway.store.writer: training_data imports only rollout_store of the "
        "other packages",
        "training_data.groups imports trainer_client.client: training_data imports only rollout_store of the "
        "other packages",
    ]


def test_shipped_code_importing_the_testbed_is_found(tmp_path):
    root = tree(
        tmp_path,
        {"gateway/fleet/pool.py": "from testbed.launcher import Gateway\n", "testbed/launcher.py": ""},
    )

    assert list(check.findings(root)) == [
        "gateway.fleet.pool imports testbed.launcher: what ships never imports the testbed"
    ]


def test_a_module_in_no_layer_is_named(tmp_path):
    root = tree(tmp_path, {"gateway/plugins.py": ""})

    assert list(check.findings(root)) == [
        "gateway.plugins is in no layer: add it to LAYERS in scripts/check_layers.py"
    ]
