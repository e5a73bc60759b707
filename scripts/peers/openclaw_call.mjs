// OpenClaw's gateway, driven through its public plugin SDK for the openclaw check (openclaw_checks.py).
//   node openclaw_call.mjs DIR call METHOD PARAMS_JSON       one gateway call; its result as JSON on stdout
//   node openclaw_call.mjs DIR wait SESSION_KEY TEXT SECONDS  poll chat.history until an assistant message
//                                                            contains TEXT; the session's messages as JSON
// DIR is the npm prefix OpenClaw is installed in; HOME and OPENCLAW_GATEWAY_TOKEN come from the environment.
// The scopes include operator.admin: `/acp spawn` needs it, and a fresh HOME's first local device is paired
// with what it asks for.
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const [dir, verb, ...rest] = process.argv.slice(2);
const sdk = join(dir, "node_modules", "openclaw", "dist", "plugin-sdk", "gateway-runtime.js");
const { callGatewayFromCli } = await import(pathToFileURL(sdk).href);
const scopes = ["operator.admin", "operator.write", "operator.read"];

function call(method, params) {
  const opts = { token: process.env.OPENCLAW_GATEWAY_TOKEN, timeout: "60000", json: true };
  return callGatewayFromCli(method, opts, params, { scopes, expectFinal: false, progress: false });
}

function text(message) {
  const content = message.content;
  if (typeof content === "string") return content;
  return (content ?? []).map((part) => part.text ?? "").join("");
}

if (verb === "call") {
  const [method, params] = rest;
  console.log(JSON.stringify(await call(method, JSON.parse(params ?? "{}"))));
} else if (verb === "wait") {
  const [sessionKey, wanted, seconds] = rest;
  const deadline = Date.now() + Number(seconds) * 1000;
  let messages = [];
  for (;;) {
    try {
      messages = ((await call("chat.history", { sessionKey })).messages ?? []).map((m) => ({
        role: m.role,
        text: text(m),
      }));
    } catch (error) {
      // The gateway stalls its event loop while it installs a plugin's dependencies, and a connection made
      // meanwhile times out its handshake: try again until the deadline.
      console.error(`chat.history: ${error}`);
    }
    if (messages.some((m) => m.role === "assistant" && m.text.includes(wanted))) break;
    if (Date.now() > deadline) {
      console.error(`no assistant message containing ${JSON.stringify(wanted)} within ${seconds}s`);
      console.log(JSON.stringify(messages));
      process.exit(3);
    }
    await new Promise((resolve) => setTimeout(resolve, 500));
  }
  console.log(JSON.stringify(messages));
} else {
  console.error(`unknown verb ${verb}`);
  process.exit(2);
}
process.exit(0);
