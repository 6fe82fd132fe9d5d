"""docs/reference.md and `python -m dtk.plan --help` list every schema key, from the schemas."""

from __future__ import annotations

import dataclasses

from conftest import REPO, run_main
from dtk.config import docs
from dtk.config.reference import COMMAND, REFERENCE, render


def _schema_classes() -> set[type]:
    """Every dataclass reachable from the root config or registered for a config group."""
    from dtk.config.schema import Config

    found: set[type] = set()

    def visit(cls: type) -> None:
        if cls in found:
            return
        found.add(cls)
        for f in dataclasses.fields(cls):
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if factory is not None and dataclasses.is_dataclass(factory):
                visit(factory)

    visit(Config)
    for options in docs.group_schemas().values():
        for cls in options.values():
            visit(cls)
    return found


def test_reference_md_is_what_the_schemas_say_now():
    assert REFERENCE == REPO / "docs" / "reference.md"
    current = REFERENCE.read_text() if REFERENCE.is_file() else ""
    assert current == render(), f"docs/reference.md is out of date with the schemas; regenerate it: {COMMAND}"


def test_reference_has_a_row_for_every_field_of_every_schema():
    text = REFERENCE.read_text()
    from dtk.config.schema import Config

    groups = docs.group_schemas()
    for cls in _schema_classes():
        field_docs = docs.field_docs(cls)
        for f in dataclasses.fields(cls):
            factory = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            doc = field_docs[f.name].replace("|", "\\|")
            if (factory is not None and dataclasses.is_dataclass(factory)) or (cls is Config and f.name in groups):
                assert doc in text, f"{cls.__name__}.{f.name}: section doc missing from docs/reference.md"
                continue  # a section, not a key: its own fields are rows
            assert f".{f.name}` |" in text or f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} missing"
            assert doc in text, f"{cls.__name__}.{f.name}: doc string missing from docs/reference.md"


def test_every_option_of_a_group_gets_its_own_section():
    text = REFERENCE.read_text()
    assert "## `data` with `data=hdf5`" in text and "## `data` with `data=synthetic`" in text
    assert "| `data.path` | `str` | `required` |" in text
    assert "| `train.steps` | `int` | `300` |" in text


def test_plan_help_lists_the_keys_of_every_data_option():
    proc = run_main("dtk.plan", "--help")
    assert proc.returncode == 0, proc.stderr
    for key, _, _doc in docs.key_table():
        assert key in proc.stdout
    assert "[data=hdf5]" in proc.stdout and "data.path" in proc.stdout and "data.val_shards" in proc.stdout
    assert "[data=synthetic]" in proc.stdout and "data.branching" in proc.stdout


def test_check_flag_agrees_with_the_file():
    proc = run_main("dtk.config.reference", "--check")
    assert proc.returncode == 0, proc.stderr


def test_inherited_fields_and_enum_values_are_documented():
    import enum
    from dataclasses import dataclass

    class Colour(str, enum.Enum):
        red = "red"
        blue = "blue"

    @dataclass
    class Base:
        shared: int = 1
        """A key every subclass has."""

    @dataclass
    class Child(Base):
        colour: Colour = Colour.red
        """The colour."""
        maybe: Colour | None = None
        """Perhaps a colour."""

    assert docs.field_docs(Child) == {"shared": "A key every subclass has.", "colour": "The colour.",
                                      "maybe": "Perhaps a colour."}
    fields = {f.name: f for f in dataclasses.fields(Child)}
    hints = {"colour": Colour, "maybe": Colour | None}
    assert docs.type_name("Colour", hints["colour"]) == "Colour (red, blue)"
    assert docs.type_name("Colour | None", hints["maybe"]) == "Colour | None (red, blue)"
    assert docs.type_name("dict[str, Colour]", dict[str, Colour]) == "dict[str, Colour]"
    assert docs.default(fields["colour"]) == "'red'"
