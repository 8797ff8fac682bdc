"""The order `make test` deals files to its workers (tests/suite_order.py)."""

import json

from suite_order import SECONDS_PER_UNKNOWN_TEST, load_costs, rank_files, write_costs


def test_the_costliest_file_is_dealt_first_whatever_its_test_count():
    nodeids = [f"tests/recipe/test_many.py::test_{n}" for n in range(50)]
    nodeids += ["tests/serve/test_long.py::test_a_restart", "tests/test_short.py::test_one"]
    costs = {"tests/recipe/test_many.py": 3.0, "tests/serve/test_long.py": 90.0}
    assert rank_files(nodeids, costs) == [
        "tests/serve/test_long.py",
        "tests/recipe/test_many.py",
        "tests/test_short.py",
    ]


def test_a_file_the_table_does_not_know_is_costed_by_its_test_count():
    many = [f"tests/test_new.py::test_{n}" for n in range(20)]
    nodeids = ["tests/test_known.py::test_one", *many]
    costs = {"tests/test_known.py": 20 * SECONDS_PER_UNKNOWN_TEST - 1}
    assert rank_files(nodeids, costs) == ["tests/test_new.py", "tests/test_known.py"]


def test_files_of_equal_cost_keep_their_collection_order():
    nodeids = ["tests/b.py::test_x", "tests/a.py::test_y", "tests/c.py::test_z"]
    assert rank_files(nodeids, {"tests/b.py": 1.0, "tests/a.py": 1.0, "tests/c.py": 1.0}) == [
        "tests/b.py",
        "tests/a.py",
        "tests/c.py",
    ]


def test_a_recorded_run_updates_its_files_keeps_the_others_and_drops_files_gone(tmp_path):
    table = tmp_path / "tests" / "file_costs.json"
    table.parent.mkdir()
    for name in ("kept.py", "measured.py"):
        (table.parent / name).touch()
    table.write_text(json.dumps({"tests/kept.py": 5.0, "tests/gone.py": 9.0}))
    write_costs({"tests/measured.py": 12.345}, table)
    assert list(load_costs(table).items()) == [("tests/measured.py", 12.3), ("tests/kept.py", 5.0)]
