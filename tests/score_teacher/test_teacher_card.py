"""The dataset card says where the teacher came from: its license and the model it was made from,
as its model card gives them (a local folder's README.md) or the settings (``teacher.license``,
``teacher.base_model``), which win; a rerun that scores nothing but gives a license rewrites the
card. Through the real command; the reference is the model card's front matter the test wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from test_teacher_name import stage1


def teacher_rows(card: str) -> dict[str, str]:
    section = card.split("## Teacher", 1)[1].split("## Corpus", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ")]
    return {k.strip(): v.strip() for k, v in rows}


def test_the_card_gives_the_teachers_license_and_base_model(micro_teacher, micro_corpus, tmp_path):
    teacher = Path(shutil.copytree(micro_teacher, tmp_path / "models" / "micro"))
    (teacher / "README.md").write_text("---\nlicense: mit\nbase_model:\n- org/micro-base\n---\n\n# micro\n")
    out = tmp_path / "scored"
    args = ["teacher.embedded=false", "teacher.name=micro", f"teacher.model={teacher}", "teacher.stride=null",
            "data.embedded=false", "data.name=micro", f"data.files=[{micro_corpus[0]}]", "data.limit_docs=4",
            f"output_dir={out}", "progress=false", "ray.num_cpus=1"]
    first = stage1(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = teacher_rows((out / "README.md").read_text())
    assert rows["license"] == "`mit`" and rows["base model"] == "`org/micro-base`"
    assert json.loads((out / "manifest.json").read_text())["teacher_origin"] == {"license": "mit",
                                                                                "base_model": "org/micro-base"}
    again = stage1(*args, "teacher.license=apache-2.0", cwd=tmp_path)  # scores nothing, the card follows the setting
    assert again.returncode == 0 and "0 scored now, 1 already done" in again.stdout, again.stderr[-3000:]
    assert teacher_rows((out / "README.md").read_text())["license"] == "`apache-2.0`"
