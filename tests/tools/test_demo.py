"""The demo's summary line says what its numbers say."""
import pathlib

from minicb.demo import latency_verdict


def test_the_latency_verdict_says_lower_or_higher_as_the_numbers_are():
    assert latency_verdict(17.5, 16.3).startswith("mean latency 1.07x lower"), latency_verdict(17.5, 16.3)
    higher = latency_verdict(16.3, 17.5)
    assert "1.07x HIGHER" in higher and "When refilling cannot win" in higher, higher
    assert latency_verdict(2.0, 2.0) == "the same mean latency"


def test_the_section_the_verdict_points_to_exists():
    text = (pathlib.Path(__file__).resolve().parents[2] / "chapters/06-continuous-batching/README.md").read_text()
    assert "### When refilling cannot win" in text, "demo.py points readers to this section of chapter 06"
