"""The calibration file as ``read_texts`` reads it (fp4convert/calibrate/samples.py): JSON lines or plain text,
broken JSON lines named by their line numbers, and only regular files read (issue 45)."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp4convert.calibrate.samples import read_texts
from fp4convert.cli.main import main
from fp4convert.errors import PlanError
from tests import zoo
from tests.calibrate.test_calibrate import add_tokenizer


def jsonl(*texts: str) -> str:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts)


def test_json_lines_and_plain_text(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(jsonl("one", "two") + "\n\n" + jsonl("three"))
    assert read_texts(f) == ["one", "two", "three"]
    prose = "A paragraph of prose.\nIt quotes one JSON example:\n" + jsonl("not a sample") + "and goes on.\n"
    f.write_text(prose)
    assert read_texts(f) == [prose]  # a JSON line among prose is part of the text


def test_broken_json_lines_among_good_ones_are_named_by_their_line_numbers(tmp_path):
    """Two broken lines among good ones were read as plain text (the samples then held the JSON syntax)."""
    lines = jsonl(*(f"sample {i}" for i in range(8))).splitlines()
    lines[2] = '"text": "a line that lost its brace"}'  # line 3
    lines[5] = '{"text": "cut short'  # line 6
    f = tmp_path / "cal.jsonl"
    f.write_text("\n".join(lines[:4]) + "\n\n" + "\n".join(lines[4:]) + "\n")  # a blank line: line 6 is file line 7
    with pytest.raises(PlanError) as e:
        read_texts(f)
    msg = str(e.value)
    assert "2 of its 8 JSON lines are broken" in msg and str(f) in msg, msg
    assert "line 3: not a JSON line" in msg and "line 7: not a JSON line" in msg, msg
    assert "line 6" not in msg and "line 4" not in msg


def test_json_lines_without_a_text_field_are_named(tmp_path):
    f = tmp_path / "cal.jsonl"
    f.write_text(jsonl("a", "b") + '{"txt": "c"}\n' + '["d"]\n' + jsonl("e"))
    with pytest.raises(PlanError, match=r"2 of its 5 JSON lines are broken \(line 3: no string 'text' field; "
                                         r"line 4: no string 'text' field\)"):
        read_texts(f)


def test_many_broken_lines_are_counted_not_all_listed(tmp_path):
    f = tmp_path / "cal.jsonl"
    f.write_text("".join('{"text": oops}\n' for _ in range(9)) + jsonl("fine"))
    msg = str(pytest.raises(PlanError, read_texts, f).value)
    assert "9 of its 10 JSON lines are broken" in msg and "and 4 more" in msg and len(re.findall(r"line \d+: ", msg)) == 5


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_named_as_such_and_does_not_block(tmp_path):
    """A FIFO was reported as "no such file"; reading one must not wait for a writer either."""
    fifo = tmp_path / "cal.fifo"
    os.mkfifo(fifo)
    result: list = []
    t = threading.Thread(target=lambda: result.append(pytest.raises(PlanError, read_texts, fifo).value), daemon=True)
    t.start()
    t.join(10)
    assert result, "read_texts blocked on a FIFO"
    msg = str(result[0])
    assert "a FIFO, not a regular file" in msg and str(fifo) in msg and "no such file" not in msg, msg


def test_a_folder_and_a_missing_file(tmp_path):
    assert "a folder, not a regular file" in str(pytest.raises(PlanError, read_texts, tmp_path).value)
    assert "no such file" in str(pytest.raises(PlanError, read_texts, tmp_path / "missing.txt").value)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_the_command_line_names_a_fifo_and_broken_lines(tmp_path):
    """Through ``quantize --method gptq``: one Error line, exit 2, nothing written."""
    src = add_tokenizer(zoo.build("llama", tmp_path / "llama"))
    fifo = tmp_path / "cal.fifo"
    os.mkfifo(fifo)
    broken = tmp_path / "cal.jsonl"
    broken.write_text(jsonl("a", "b") + "{oops\n" + jsonl("c"))
    for data, says in ((fifo, "a FIFO, not a regular file"), (broken, "line 3: not a JSON line")):
        dst = tmp_path / "out"
        r = CliRunner().invoke(main, ["quantize", str(src), str(dst), "--device", "cpu", "--method", "gptq",
                                      "--calibration-data", str(data)])
        errors = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
        assert r.exit_code == 2 and len(errors) == 1 and says in errors[0], r.output
        assert not Path(dst).exists()
