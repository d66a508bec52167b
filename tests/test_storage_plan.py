"""The storage plan (`storage.plan.resolve_storage`): the guide's table of storage option combinations, row by row,
each refusal one line naming the fix, and what a host budget chooses stated in the plan, never silent. Pure: no
model, no device, the machine's facts made up."""

from __future__ import annotations

import ast
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import flextensor_diffusers as ft
from flextensor_diffusers.recipes import wan22_t2v
from flextensor_diffusers.storage.machine_memory import HOST, AvailableMemory, MemoryBound
from flextensor_diffusers.storage.plan import (
    UNTRUSTED_COMPRESSED_TIER,
    Encoding,
    HostCopiesSize,
    MachineFacts,
    Rule,
    StorageOptionError,
    StoragePlan,
    StorageRequest,
    resolve_storage,
)

GUIDE = Path(__file__).parent.parent / "docs" / "guide.md"
HEADING = "## Storage options combined"
GiB = 2**30
RAM = AvailableMemory((MemoryBound(HOST, "made up by the test", 128 * GiB, 100 * GiB),))
FITS = HostCopiesSize(packed_bytes=10 * GiB, new_bytes=10 * GiB)  # 11 GiB with the reserve: under 80 GiB
DOES_NOT_FIT = HostCopiesSize(packed_bytes=200 * GiB, new_bytes=200 * GiB)


@dataclass(frozen=True)
class Row:
    """One row of the guide's table, as written."""

    line: int
    asked: dict[str, Any]
    device: str
    fit: str
    cells: dict[str, str]  # the resolved columns, by their heading
    outcome: str  # "refused: `...`", "stated: a, b; warns: ...", or empty


def guide_rows() -> list[Row]:
    """The table under `HEADING` in docs/guide.md, parsed."""
    lines = GUIDE.read_text().splitlines()
    start = lines.index(HEADING)
    table = []
    for number, text in enumerate(lines[start:], start + 1):
        if text.startswith("|"):
            table.append((number, [cell.strip() for cell in text.strip().strip("|").split("|")]))
        elif table:
            break
    (_, head), _separator, *body = table
    rows = []
    for number, cells in body:
        named = dict(zip(head, cells, strict=True))
        rows.append(
            Row(number, asked(named["asked"]), named["device"], named["fit"], named, named["refused, or stated"])
        )
    return rows


def asked(cell: str) -> dict[str, Any]:
    """``(defaults)``, or keywords as Python writes them: ``compression="lossless", host_budget=None``."""
    if cell == "(defaults)":
        return {}
    call = ast.parse(f"f({cell.strip('`')})", mode="eval").body
    assert isinstance(call, ast.Call)
    return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}


def request_of(keywords: dict[str, Any]) -> StorageRequest:
    """What ``enable_flextensor_offload(**keywords)`` asks the plan (its ``host_budget`` default: ``"auto"``)."""
    keywords = {"host_budget": "auto", **keywords}
    shared = keywords.pop("shared_host", None) is not None
    return StorageRequest(shared_host=shared, **keywords)


def facts_of(row: Row) -> list[MachineFacts]:
    devices = ["cuda", "cpu"] if row.device == "any" else [row.device]
    copies = {"yes": [FITS], "no": [DOES_NOT_FIT], "any": [FITS, DOES_NOT_FIT]}[row.fit]
    return [MachineFacts(d, ram=RAM, held_bytes=GiB, host_copies=c) for d in devices for c in copies]


def yes(flag: bool) -> str:
    return "yes" if flag else "no"


def described(plan: StoragePlan) -> dict[str, str]:
    """The plan in the table's words."""
    tier = plan.host_tier
    return {
        "raw copies": plan.raw_copies,
        "payload file": yes(plan.compression_cache),
        "progressive packing": yes(plan.progressive_packing),
        "encoding": plan.encoding.value,
        "verify loads": yes(plan.verify_loads),
        "host tier": "no" if tier is None else "auto" if tier.auto else "sized",
    }


def stated(plan: StoragePlan) -> str:
    """What the plan stated, in the table's words."""
    parts = ["stated: " + ", ".join(choice.option for choice in plan.choices)] if plan.choices else []
    parts += ["warns: not to be trusted yet"] if plan.warnings == (UNTRUSTED_COMPRESSED_TIER,) else []
    return "; ".join(parts)


ROWS = guide_rows()


def test_the_guide_has_its_table() -> None:
    assert len(ROWS) >= 30
    assert any(row.outcome.startswith("refused") for row in ROWS)
    assert any(row.outcome.startswith("stated") for row in ROWS)


@pytest.mark.parametrize("row", ROWS, ids=[f"guide.md:{row.line}" for row in ROWS])
def test_every_row_of_the_guide_is_what_resolve_storage_does(row: Row) -> None:
    request = request_of(row.asked)
    for machine in facts_of(row):
        if row.outcome.startswith("refused: "):
            fragment = row.outcome.removeprefix("refused: ").strip("`")
            with pytest.raises(ft.FlexTensorError) as refused:
                resolve_storage(request, machine)
            message = str(refused.value)
            assert fragment in message and "\n" not in message, (row.line, machine, message)
            continue
        plan = resolve_storage(request, machine)
        wanted = {column: row.cells[column] for column in described(plan)}
        assert described(plan) == wanted, (row.line, machine)
        assert stated(plan) == row.outcome, (row.line, machine)


REFUSALS = [
    (StorageRequest(compression="zstd"), Rule.COMPRESSION_MODE, "pass 'lossless' or 'none'"),
    (StorageRequest(raw_copies="tape"), Rule.RAW_PLACE, "is not 'ram', 'disk' or 'none'"),
    (StorageRequest(raw_copies="disk"), Rule.RAW_DISK_WITHOUT_COMPRESSION, "pass compression='lossless'"),
    (StorageRequest(compression_cache=True), Rule.CACHE_WITHOUT_COMPRESSION, "pass compression='lossless'"),
    (StorageRequest(background_encoding=True), Rule.BACKGROUND_WITHOUT_RAW_STREAM, "it needs compression="),
    (
        StorageRequest(compression="lossless", shared_host=True),
        Rule.COMPRESSION_WITH_SHARED_HOST,
        "pass one of them",
    ),
    (
        StorageRequest(shared_host=True, host_budget="8GiB"),
        Rule.HOST_BUDGET_WITH_SHARED_HOST,
        'drop host_budget (its default, "auto", keeps the shared copy in RAM)',
    ),
    (
        StorageRequest(compression="lossless", raw_copies="ram", host_budget="8GiB"),
        Rule.TIER_KEEPS_COMPRESSED_ONLY,
        "drop raw_copies='ram' (it needs raw_copies='none' or 'disk')",
    ),
    (
        StorageRequest(progressive_packing=True, host_budget="8GiB"),
        Rule.TIER_HOLDS_NO_SECOND_COPY,
        "drop progressive_packing, or pass host_budget=None (--host-budget none)",
    ),
]


@pytest.mark.parametrize(("request_", "rule", "fix"), REFUSALS, ids=[rule.value for _, rule, _ in REFUSALS])
def test_each_refusal_is_one_line_naming_the_fix(request_: StorageRequest, rule: Rule, fix: str) -> None:
    with pytest.raises(StorageOptionError) as refused:
        resolve_storage(request_, MachineFacts("cuda"))
    assert refused.value.rule is rule and fix in str(refused.value) and "\n" not in str(refused.value)


def test_host_copies_over_the_ram_with_host_budget_none_are_refused_naming_auto() -> None:
    machine = MachineFacts("cpu", ram=RAM, host_copies=DOES_NOT_FIT)
    with pytest.raises(ft.HostBudgetError, match=r'leave host_budget at "auto" \(--host-budget auto\)'):
        resolve_storage(StorageRequest(host_budget=None), machine)


def test_what_a_host_budget_chooses_is_stated_not_silent() -> None:
    """Under a host tier with compression on CUDA, every option left to the plan and set by it is stated with
    why, naming the host budget ("auto" names the RAM); options given are not restated."""
    auto = resolve_storage(
        StorageRequest(compression="lossless", host_budget="auto"),
        MachineFacts("cuda", ram=RAM, held_bytes=GiB, host_copies=DOES_NOT_FIT),
    )
    chosen = {choice.option: choice for choice in auto.choices}
    assert chosen.keys() == {"progressive_packing", "raw_copies", "compression_cache", "verify_loads"}
    assert (chosen["raw_copies"].value, chosen["compression_cache"].value) == ("none", True)
    assert 'host_budget="auto" turned the host tier on' in chosen["raw_copies"].why
    assert auto.host_tier is not None and auto.host_tier.budget_bytes == GiB + int(100 * GiB * 0.8)
    assert all(line in auto.as_dict()["chosen"] for line in map(lambda c: c.line(), auto.choices))
    given = resolve_storage(
        StorageRequest(compression="lossless", raw_copies="disk", progressive_packing=False, host_budget="8GiB"),
        MachineFacts("cpu"),
    )
    assert [choice.option for choice in given.choices] == ["compression_cache"]
    assert "a host budget with compression" in given.choices[0].why
    assert resolve_storage(StorageRequest(compression="lossless"), MachineFacts("cuda")).choices == ()


def test_set_up_reads_what_it_does_from_the_plan() -> None:
    """The predicates set-up takes (`SetUp.run`) for the three ways a set-up goes."""
    raw = resolve_storage(StorageRequest(), MachineFacts("cuda"))
    assert raw.packs_progressively and not raw.may_read_payloads_later and not raw.writes_cache_files
    cached = resolve_storage(StorageRequest(compression="lossless", compression_cache=True), MachineFacts("cuda"))
    assert not cached.packs_progressively and cached.may_read_payloads_later and cached.writes_cache_files
    assert cached.encoding is Encoding.WHERE_ROOM
    assert cached.encodes_between_forwards(encoder_fits=True) and not cached.encodes_between_forwards(False)
    only = resolve_storage(StorageRequest(compression="lossless", raw_copies="disk"), MachineFacts("cuda"))
    assert only.compressed_only and only.writes_cache_files and not only.may_read_payloads_later
    assert only.encodes_between_forwards(encoder_fits=True) and not only.encodes_between_forwards(False)
    assert not only.between_forwards_needs_weight_files  # the cache file streams what the files do not hold
    first = StorageRequest(compression="lossless", raw_copies="disk", background_encoding=False)
    assert not resolve_storage(first, MachineFacts("cuda")).encodes_between_forwards(encoder_fits=True)
    none = resolve_storage(StorageRequest(compression="lossless", raw_copies="none"), MachineFacts("cuda"))
    assert none.compressed_only and not none.writes_cache_files  # no raw copy written, and no payload file asked
    assert none.encoding is Encoding.WHERE_ROOM_AND_FILES and none.between_forwards_needs_weight_files
    assert none.encodes_between_forwards(encoder_fits=True) and not none.encodes_between_forwards(False)


def test_offload_config_and_the_command_line_take_the_same_plan(capsys) -> None:
    """`OffloadConfig` holds the plan its fields resolve to; the command line refuses a combination with the
    plan's rule in its flags' words, before anything loads."""
    config = ft.OffloadConfig(include_patterns=["blocks.*"], device="cpu", compression="lossless")
    assert config.storage == resolve_storage(StorageRequest(compression="lossless"), MachineFacts("cpu"))
    with pytest.raises(StorageOptionError, match="pass compression='lossless'"):
        ft.OffloadConfig(include_patterns=["blocks.*"], raw_copies="disk")
    argv = ["--random-weights", "tiny", "--device", "cpu", "-q", "--gpus", "2", "--compression", "lossless"]
    with pytest.raises(SystemExit):
        wan22_t2v.cli(argv)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --compression lossless cannot be combined with --gpus 2 yet") and "\n" not in err


def test_a_pipeline_states_what_its_host_budget_chose_in_its_report(tmp_path, caplog) -> None:
    """enable: a host budget with compression logs each choice it made and the report carries them."""
    from flextensor_diffusers.pipelines.offload import format_report
    from flextensor_diffusers.recipes.models import build_pipeline

    pipe = build_pipeline("wan22_t2v", "tiny")
    with caplog.at_level(logging.INFO, logger="flextensor_diffusers.pipelines.offload"):
        pipe.enable_flextensor_offload(
            budget=10**9, device="cpu", compression="lossless", host_budget="8GiB", cache_dir=tmp_path
        )
    try:
        report = pipe.flextensor_report()
        chosen = report["storage"]["chosen"]
        assert [line.split("=")[0] for line in chosen] == ["progressive_packing", "raw_copies", "compression_cache"]
        assert all(f"storage plan: {line}" in caplog.text for line in chosen)
        assert "storage plan chose: progressive_packing=False" in format_report(report)
        assert all(h.config.compressed_only for h in ft.pipeline_offload(pipe).handles.values() if h.units)
    finally:
        pipe.disable_flextensor_offload()
