// Ordinary calls a TypeScript user writes with openapi-fetch on the types openapi-typescript
// generates from the server's /openapi.json, both with their default options: an enqueue that
// leaves every optional member out, and an apply of one `node.insert` (tests/outside/
// test_openapi_typescript.py compiles this file with `tsc --noEmit`).
import createClient from "openapi-fetch";
import type { components, paths } from "./api";

const client = createClient<paths>({ baseUrl: "http://127.0.0.1:8080" });

export async function enqueue(): Promise<string> {
  const { data, error } = await client.POST("/v1/workspaces/{ws}/requests", {
    params: { path: { ws: "ws1" } },
    body: { stage: "thumbnail", input: { page: 1 } },
  });
  if (error) {
    return error.code;
  }
  return data.request_id;
}

export async function apply(): Promise<number | string> {
  const insert: components["schemas"]["NodeInsert"] = {
    type: "node.insert",
    node_id: "a",
    parent_id: "root",
  };
  const { data, error } = await client.POST("/v1/workspaces/{ws}/docs/{sub_doc}/ops", {
    params: { path: { ws: "ws1", sub_doc: "tree" } },
    body: { ops: [insert] },
  });
  if (error) {
    return error.code;
  }
  return data.results.length;
}
