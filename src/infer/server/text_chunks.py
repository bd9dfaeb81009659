"""Streaming chunks that carry only text, without building a response model per chunk.

Most chunks of a stream differ from each other only in their text: no logprobs, no finish
reason yet. For those, the response model is serialized once per choice with a marker in
place of the text, and each chunk is that JSON with the marker's place filled by the
text's JSON string (`json.dumps(..., ensure_ascii=False)` writes a string as pydantic
does). Other chunks (the last one, logprobs) still go through the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from infer.engine.outputs import CompletionOutput

_MARKER = "infer-text-marker-7f3a9c"
_MARKER_JSON = json.dumps(_MARKER)

Render = Callable[[int, CompletionOutput], str]


def with_text_fast_path(render: Render) -> Render:
    """`render` (choice index, delta) -> chunk JSON, made cheap for plain text deltas.

    The text field is the response's last string field set from the delta (it comes after
    id and model), so the marker's last occurrence is where the text goes.
    """
    templates: dict[int, tuple[str, str]] = {}

    def chunk(index: int, delta: CompletionOutput) -> str:
        if delta.finish_reason is not None or delta.logprobs is not None:
            return render(index, delta)
        template = templates.get(index)
        if template is None:
            marked = render(index, CompletionOutput(index, _MARKER, []))
            head, found, tail = marked.rpartition(_MARKER_JSON)
            if not found:
                raise AssertionError(f"the chunk has no text field: {marked}")
            template = templates[index] = (head, tail)
        return template[0] + json.dumps(delta.text, ensure_ascii=False) + template[1]

    return chunk
