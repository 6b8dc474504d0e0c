"""The official `openai` Python client against a running lift-serve on the real default model:
models.list(), a chat completion and a streamed chat completion with a document id as model, and
the tokens' log-probabilities (`logprobs`, `top_logprobs`) of both.
Usage: LIFT_URL=http://127.0.0.1:PORT python scripts/openai_client_check.py DOCUMENT.txt"""
import json
import os
import sys
import time
import urllib.request

from openai import OpenAI

base = os.environ["LIFT_URL"].rstrip("/")
text = open(sys.argv[1], encoding="utf-8").read()

req = urllib.request.Request(base + "/documents", data=text.encode(), headers={"content-type": "text/plain"})
doc = json.load(urllib.request.urlopen(req))
doc_id = doc["id"]
deadline = time.time() + 600
while doc["status"] not in ("ready", "failed", "cancelled"):
    assert time.time() < deadline, f"document not ready in time: {doc}"
    time.sleep(1)
    doc = json.load(urllib.request.urlopen(base + "/documents/" + doc_id))
assert doc["status"] == "ready", doc

client = OpenAI(base_url=base + "/v1", api_key="not-needed-without-keys")
ids = [m.id for m in client.models.list().data]
assert doc_id in ids, ids

question = [{"role": "user", "content": "Who founded the Saltmere Harbor Company?"}]
reply = client.chat.completions.create(model=doc_id, messages=question, max_tokens=32, temperature=0)
answer = reply.choices[0].message.content
assert answer and answer.strip(), reply
assert reply.usage.completion_tokens > 0, reply

pieces = []
for chunk in client.chat.completions.create(model=doc_id, messages=question, max_tokens=32, temperature=0, stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        pieces.append(chunk.choices[0].delta.content)
streamed = "".join(pieces)
assert streamed == answer, (streamed, answer)

# Log-probabilities: one entry per generated token, their bytes spell the answer (no stop string
# cut it), and greedy decoding picked the most likely token at every step.
scored = client.chat.completions.create(model=doc_id, messages=question, max_tokens=32, temperature=0,
                                        logprobs=True, top_logprobs=3)
assert scored.choices[0].message.content == answer, (scored.choices[0].message.content, answer)
content = scored.choices[0].logprobs.content
assert len(content) == scored.usage.completion_tokens, (len(content), scored.usage)
assert bytes(b for t in content for b in t.bytes).decode("utf-8") == answer, content
for t in content:
    assert t.logprob <= 0.0 and len(t.top_logprobs) == 3, t
    tops = [a.logprob for a in t.top_logprobs]
    assert tops == sorted(tops, reverse=True), t
    assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-6, t
last = None
for chunk in client.chat.completions.create(model=doc_id, messages=question, max_tokens=32, temperature=0,
                                            stream=True, logprobs=True):
    if chunk.choices and chunk.choices[0].logprobs:
        last = chunk.choices[0].logprobs.content
assert last is not None and [t.logprob for t in last] == [t.logprob for t in content], last
mean = sum(t.logprob for t in content) / len(content)
print(f"openai client: models {len(ids)}, answer {answer!r} (mean token log-probability {mean:.3f}), "
      f"streamed {len(pieces)} chunks: 1 passed, 0 failed")
