"""``fedclinic task watch TASK --eval test.jsonl`` over real services: each round's model, fetched with the
scientist's certificate as the round closes, scored on the scientist's own file."""

from __future__ import annotations

import io

import pytest

from fedclinic.cli import main
from fedclinic.client import state_name
from fedclinic.federation.own_files import read_rows
from fedclinic.federation.round_scoring import watch_and_score
from fedclinic.models import build_model
from fedclinic.training.trainer import encode, evaluate
from fedclinic.transport.package import ModelPackage

from tests.helpers.own_files import write_jsonl
from tests.helpers.tasks import make_task
from tests.helpers.text_models import make_examples, tiny_package

pytestmark = pytest.mark.integration


def test_watch_eval_prints_each_rounds_figure_equal_to_a_local_evaluation(federation_factory, tmp_path, capsys):
    fed = federation_factory(2, samples=(24, 32))
    test = write_jsonl(tmp_path / "test.jsonl", make_examples(20, 9))
    c = fed.creds("scientist")
    conn = ["--address", fed.address, "--cert", c["cert"], "--key", c["key"], "--ca", c["ca"]]
    with fed.client() as client:
        st = client.submit(make_task(min_sites=2, num_rounds=2), package=tiny_package("logreg"))
        # the CLI follows the task live and scores each round as it closes
        assert main(["task", "watch", st.task_id, "--eval", str(test), *conn]) == 0
        out = capsys.readouterr().out
        final = client.status(st.task_id)
        assert state_name(final.state) == "completed", final.error
        lines = [line for line in out.splitlines() if line.startswith("round ")]
        assert len(lines) == 2
        # each round's figure is that of the downloaded round model evaluated here on the same file
        local = {}
        for r in (1, 2):
            loaded = build_model(ModelPackage.load(client.download(st.task_id, tmp_path / f"round-{r}", round=r)))
            local[r] = evaluate(loaded, encode(read_rows(final.spec, test), loaded, max_length=16))
            assert lines[r - 1] == (f"round {r}: your test set (20 rows) accuracy {local[r]['accuracy']:.4f} "
                                    f"loss {local[r]['loss']:.4f}")
        # exactly, not only to four digits: the function the command runs, over the finished task's events
        scored = watch_and_score(client, st.task_id, test, out=io.StringIO())
        assert sorted(scored.rounds) == [1, 2]
        for r in (1, 2):
            assert {k: v for k, v in scored.rounds[r].items() if k != "eval_rows"} == \
                {k: v for k, v in local[r].items() if k != "n"}
            assert scored.rounds[r]["eval_rows"] == 20.0
        # a bad test file: the reader's error (file, row, what to do) before any model is fetched
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "aura", "label": "neuro"}\n{"text": "heart", "label": "cardiology"}\n')
        assert main(["task", "watch", st.task_id, "--eval", str(bad), *conn]) == 2
        assert f"{bad}: row 2: unknown label 'cardiology'" in capsys.readouterr().err
