"""A small BigQuery REST server on loopback for tests: tables in memory, real HTTP/JSON.

It answers the six endpoints google-cloud-bigquery needs to get a table, page through its rows and run
``SELECT [cols|*] FROM `p.d.t` [LIMIT n]`` queries, under ``/bigquery/v2/projects/{project}/``:
``POST jobs``, ``GET jobs/{id}``, ``POST queries``, ``GET queries/{id}`` (paged),
``GET datasets/{d}/tables/{t}``, ``GET datasets/{d}/tables/{t}/data`` (paged: startIndex, maxResults,
pageToken, selectedFields). Point the client at it with ``BIGQUERY_EMULATOR_HOST=http://127.0.0.1:PORT``.

Why a second BigQuery double beside bqemulator (``tests/bqemulator_launcher.py``, the Storage Read API
tests): ``test_bigquery.py`` proves the REST reader pages over HTTP by counting the requests it sent
(:attr:`FakeBigQuery.requests`), which bqemulator does not report, and this server starts in-process in
milliseconds with no separate virtualenv. Tests of the Storage Read path, resume and sessions use bqemulator.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

DEFAULT_PAGE = 1000
_QUERY = re.compile(
    r"^\s*SELECT\s+(?P<cols>.+?)\s+FROM\s+`(?P<table>[^`]+)`(?:\s+LIMIT\s+(?P<limit>\d+))?\s*;?\s*$", re.I
)


def _cell(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [{"v": _cell(v)} for v in value]
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class FakeBigQuery:
    """``add_table("p.d.t", schema=[("id", "INTEGER"), ...], rows=[{...}])``; ``requests`` logs the calls."""

    def __init__(self) -> None:
        self.tables: dict[str, tuple[list[dict[str, str]], list[dict[str, Any]]]] = {}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeBigQuery:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def add_table(
        self, table_id: str, schema: list[tuple[str, str] | tuple[str, str, str]], rows: list[dict]
    ) -> None:
        fields = [{"name": f[0], "type": f[1], "mode": f[2] if len(f) > 2 else "NULLABLE"} for f in schema]
        self.tables[table_id] = (fields, rows)

    # -- responses ----------------------------------------------------------------------------------
    def _table_resource(self, project: str, dataset: str, table: str) -> dict[str, Any] | None:
        found = self.tables.get(f"{project}.{dataset}.{table}")
        if found is None:
            return None
        fields, rows = found
        return {
            "kind": "bigquery#table",
            "id": f"{project}:{dataset}.{table}",
            "tableReference": {"projectId": project, "datasetId": dataset, "tableId": table},
            "schema": {"fields": fields},
            "numRows": str(len(rows)),
            "type": "TABLE",
            "location": "US",
        }

    def _page(
        self, fields: list[dict[str, str]], rows: list[dict], query: dict[str, list[str]]
    ) -> dict[str, Any]:
        start = int(query.get("pageToken", query.get("startIndex", ["0"]))[0])
        size = int(query.get("maxResults", [str(DEFAULT_PAGE)])[0])
        selected = query.get("selectedFields", [""])[0]
        names = selected.split(",") if selected else [f["name"] for f in fields]
        page = rows[start : start + size]
        body: dict[str, Any] = {
            "totalRows": str(len(rows)),
            "rows": [{"f": [{"v": _cell(row.get(name))} for name in names]} for row in page],
        }
        if start + size < len(rows):
            body["pageToken"] = str(start + size)
        return body

    def _run_query(self, project: str, sql: str) -> dict[str, Any]:
        match = _QUERY.match(sql)
        if not match or match["table"] not in self.tables:
            raise ValueError(f"the fake only runs SELECT ... FROM `project.dataset.table` [LIMIT n]: {sql!r}")
        fields, rows = self.tables[match["table"]]
        cols = [c.strip() for c in match["cols"].split(",")]
        if cols != ["*"]:
            fields = [f for f in fields if f["name"] in cols]
        if match["limit"]:
            rows = rows[: int(match["limit"])]
        job_id = uuid.uuid4().hex
        job = {
            "kind": "bigquery#job",
            "id": f"{project}:US.{job_id}",
            "jobReference": {"projectId": project, "jobId": job_id, "location": "US"},
            "configuration": {"query": {"query": sql, "useLegacySql": False}, "jobType": "QUERY"},
            "status": {"state": "DONE"},
            "statistics": {
                "creationTime": "0",
                "startTime": "0",
                "endTime": "0",
                "query": {"totalBytesProcessed": "0"},
            },
            "_fields": fields,
            "_rows": rows,
        }
        self.jobs[job_id] = job
        return job

    @staticmethod
    def _public(job: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in job.items() if not k.startswith("_")}

    def _query_results(self, job: dict[str, Any], query: dict[str, list[str]]) -> dict[str, Any]:
        body = self._page(job["_fields"], job["_rows"], query)
        body.update(
            kind="bigquery#getQueryResultsResponse",
            jobReference=job["jobReference"],
            schema={"fields": job["_fields"]},
            jobComplete=True,
        )
        return body

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                fake.requests.append((method, url.path))
                length = int(self.headers.get("Content-Length") or 0)
                payload = json.loads(self.rfile.read(length) or b"{}") if length else {}
                parts = url.path.strip("/").split("/")
                if parts[:3] != ["bigquery", "v2", "projects"] or len(parts) < 5:
                    return self._send(404, {"error": {"code": 404, "message": f"no route {url.path}"}})
                project, rest = parts[3], parts[4:]
                try:
                    if (
                        method == "GET"
                        and len(rest) in (4, 5)
                        and rest[0] == "datasets"
                        and rest[2] == "tables"
                    ):
                        resource = fake._table_resource(project, rest[1], rest[3])
                        if resource is None:
                            msg = f"Not found: Table {project}:{rest[1]}.{rest[3]}"
                            return self._send(
                                404, {"error": {"code": 404, "message": msg, "status": "NOT_FOUND"}}
                            )
                        if len(rest) == 4:
                            return self._send(200, resource)
                        fields, rows = fake.tables[f"{project}.{rest[1]}.{rest[3]}"]
                        return self._send(
                            200, {"kind": "bigquery#tableDataList", **fake._page(fields, rows, query)}
                        )
                    if method == "POST" and rest == ["jobs"]:
                        sql = payload["configuration"]["query"]["query"]
                        return self._send(200, fake._public(fake._run_query(project, sql)))
                    if method == "POST" and rest == ["queries"]:
                        job = fake._run_query(project, payload["query"])
                        q = {"maxResults": [str(payload["maxResults"])]} if payload.get("maxResults") else {}
                        body = fake._query_results(job, q)
                        body["kind"] = "bigquery#queryResponse"
                        return self._send(200, body)
                    if method == "GET" and len(rest) == 2 and rest[0] in ("jobs", "queries"):
                        job = fake.jobs.get(rest[1])
                        if job is None:
                            return self._send(
                                404, {"error": {"code": 404, "message": f"Not found: Job {rest[1]}"}}
                            )
                        if rest[0] == "jobs":
                            return self._send(200, fake._public(job))
                        return self._send(200, fake._query_results(job, query))
                except (KeyError, ValueError) as err:
                    return self._send(
                        400, {"error": {"code": 400, "message": str(err), "status": "INVALID_ARGUMENT"}}
                    )
                return self._send(404, {"error": {"code": 404, "message": f"no route {method} {url.path}"}})

            def do_GET(self) -> None:  # noqa: N802
                self._route("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._route("POST")

        return Handler
