"""The report's HTML: one file holding its data (JSON), styles and script, so it opens offline from anywhere."""

from __future__ import annotations

import html
import json
from importlib import resources
from typing import Any


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def finite(data: Any) -> Any:
    """`data` with every NaN and infinity as None: JSON has no such numbers and the page's JSON.parse refuses them,
    but a metrics file (or a sample, the config) may hold them. Done by a round trip through the C JSON codec, so
    no Python recursion walks hostile nesting."""
    return json.loads(json.dumps(data, default=str), parse_constant=lambda _: None)


def render(data: dict[str, Any]) -> str:
    # "<" escaped, so no text of a sample can close the <script> element that carries the data
    payload = json.dumps(finite(data), allow_nan=False).replace("<", "\\u003c")
    title = html.escape(f"lichen report: {data.get('run_dir', '')}")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="generator" content="lichen report"><title>{title}</title>'
        f"<style>{_asset('report.css')}</style></head><body>"
        "<noscript>This report draws its charts with JavaScript; enable it to see them.</noscript>"
        f'<script id="report-data" type="application/json">{payload}</script>'
        f"<script>{_asset('report.js')}</script></body></html>\n"
    )
