"""The Spark packages are pinned in three places that must agree: the PySpark pin in
pyproject.toml, ``cdcd.spark.session.PACKAGES`` (the ``--packages`` line and the fallback when
the jars are not cached) and ``scripts/maven/spark/pom.xml`` (what ``scripts/setup`` fetches)."""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NS = {"m": "http://maven.apache.org/POM/4.0.0"}


def _session_module() -> str:
    return (ROOT / "cdcd" / "spark" / "session.py").read_text()


def test_pom_packages_and_pyspark_pin_agree() -> None:
    text = _session_module()
    spark = re.search(r'SPARK_VERSION = "([^"]+)"', text)
    hadoop = re.search(r'HADOOP_VERSION = "([^"]+)"', text)
    assert spark and hadoop
    pin = re.search(r'"pyspark\[connect\]==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and pin.group(1) == spark.group(1)
    block = text[text.index("PACKAGES = (") : text.index(")\n", text.index("PACKAGES = ("))]
    packages = {
        p.replace("{SPARK_VERSION}", spark.group(1)).replace("{HADOOP_VERSION}", hadoop.group(1))
        for p in re.findall(r'"([^"]+:[^"]+:[^"]+)"', block)
    }
    pom = ET.parse(ROOT / "scripts" / "maven" / "spark" / "pom.xml").getroot()
    deps = pom.findall("m:dependencies/m:dependency", NS)
    pinned = {
        ":".join(
            d.findtext(f"m:{f}", namespaces=NS) or "" for f in ("groupId", "artifactId", "version")
        )
        for d in deps
    }
    assert pinned == packages
    minor = ".".join(spark.group(1).split(".")[:2])
    for coordinate in pinned:  # every Scala artifact is built for this Spark minor version
        artifact = coordinate.split(":")[1]
        if "spark" in artifact and artifact.endswith("_2.13") and "kafka" not in artifact:
            assert f"{minor}_2.13" in artifact or f"-{minor}_2.13" in artifact, coordinate


def test_delta_reads_its_log_with_no_more_tasks_than_local_cores() -> None:
    from cdcd.spark.session import log_tasks

    assert log_tasks("local[2]", 8) == 2
    assert log_tasks("local[4,3]", 2) == 2
    assert log_tasks("local", 8) == 1
    assert log_tasks("local[*]", 1) == 1
    assert 1 <= log_tasks("local[*]", 10_000) <= (os.cpu_count() or 1)
    assert log_tasks("spark://host:7077", 8) == 8
