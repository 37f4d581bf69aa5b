"""docs/crd-reference.md is generated from the models; it must match what the generator writes today."""

from pathlib import Path

from kubeps.operator.api import reference

REPO = Path(__file__).resolve().parents[2]


def test_reference_page_is_current():
    committed = (REPO / "docs" / "crd-reference.md").read_text()
    assert committed == reference.render(), (
        "docs/crd-reference.md is stale: run  python -m kubeps.operator.api.reference > docs/crd-reference.md")


def test_reference_names_every_run_policy_field_and_rule():
    page = reference.render()
    for field in ("cleanPodPolicy", "backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "suspend",
                  "retryableExitCodes", "schedulingPolicy", *(f"schedulingPolicy.{name}" for name in (
                      "minAvailable", "queue", "priorityClass", "scheduleTimeoutSeconds", "minResources"))):
        assert f"`spec.runPolicy.{field}`" in page, field
    assert "| `spec.successPolicy` | string |  | `\"ChiefOnly\"` | one of `ChiefOnly`, `AllWorkers` |" in page
    assert "| `spec.runPolicy.schedulingPolicy.minResources` | map[string]int-or-string |" in page
    assert "is immutable unless the job is suspended" in page
    assert "| `spec.runPolicy.suspend` | boolean |  | `false` |" in page
