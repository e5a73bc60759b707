// An ACP client on the TypeScript SDK's experimental network transports (WebSocket, streamable HTTP),
// against acp-proxy serve.
//
// usage: node sdk_remote_client.mjs URL TOKEN ws|http CWD   (NODE_PATH: the SDK's and ws's node_modules)
//
// As the SDK documents a client's reconnect: initialize, session/new, two prompts; the connection closed; a
// new transport connection, initialize (loadSession checked), session/load of the same id, a third prompt.
// Over HTTP the SDK opens a session's event stream before it sends session/load; a load of an id this
// token may not see must fail that session alone, not the connection. Prints a JSON summary.
import { createRequire } from "node:module";
import { join } from "node:path";

// Resolved from NODE_PATH (an ES module's own imports ignore it).
const require = createRequire(join((process.env.NODE_PATH || ".").split(":")[0], "resolve-here.js"));
const acp = await import(require.resolve("@agentclientprotocol/sdk"));
const { createWebSocketStream } = await import(require.resolve("@agentclientprotocol/sdk/experimental/ws-client"));
const { createHttpStream } = await import(require.resolve("@agentclientprotocol/sdk/experimental/http-client"));
const { WebSocket } = require("ws");

const [url, token, kind, cwd] = process.argv.slice(2);
const PROMPTS = ["first prompt mango", "second prompt kiwi", "third prompt after the reconnect"];
const headers = { Authorization: `Bearer ${token}` };

function stream() {
  return kind === "ws"
    ? createWebSocketStream(url.replace(/^http/, "ws"), { headers, WebSocket })
    : createHttpStream(url, { headers });
}

function withTimeout(promise, what, seconds = 60) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer in ${seconds}s`)), seconds * 1000);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

async function connection(seen, work) {
  const app = acp.client({ name: "check-peers-typescript-sdk" }).onNotification(
    acp.methods.client.session.update,
    ({ params }) => {
      const update = params.update;
      const text = update?.content?.text;
      if (typeof text === "string") {
        (update.sessionUpdate === "agent_message_chunk" ? seen.texts : seen.userTexts).push(text);
      }
    },
  );
  return app.connectWith(stream(), async (ctx) => {
    const init = await withTimeout(
      ctx.request(acp.methods.agent.initialize, {
        protocolVersion: acp.PROTOCOL_VERSION,
        clientCapabilities: {},
        clientInfo: { name: "check-peers-typescript-sdk", version: "1.0.0" },
      }),
      "initialize",
    );
    return work(ctx, init);
  });
}

async function turn(ctx, seen, sessionId, words) {
  seen.texts.length = 0;
  const answer = await withTimeout(
    ctx.request(acp.methods.agent.session.prompt, { sessionId, prompt: [{ type: "text", text: words }] }),
    "session/prompt",
  );
  await new Promise((resolve) => setTimeout(resolve, 50)); // updates are handled as they arrive
  return { stopReason: answer.stopReason, text: seen.texts.join("") };
}

const first = { texts: [], userTexts: [] };
const summary = {};
summary.turns = await connection(first, async (ctx) => {
  const made = await withTimeout(ctx.request(acp.methods.agent.session.new, { cwd, mcpServers: [] }), "session/new");
  summary.sessionId = made.sessionId;
  return [await turn(ctx, first, made.sessionId, PROMPTS[0]), await turn(ctx, first, made.sessionId, PROMPTS[1])];
});
const again = { texts: [], userTexts: [] };
await connection(again, async (ctx, init) => {
  summary.loadSession = Boolean(init.agentCapabilities?.loadSession);
  try {
    await withTimeout(
      ctx.request(acp.methods.agent.session.load, { sessionId: "never-made-here", cwd, mcpServers: [] }),
      "session/load of an unknown id",
    );
    summary.unknownLoad = "answered";
  } catch (error) {
    summary.unknownLoad = String(error?.code ?? error?.message ?? error);
  }
  await withTimeout(
    ctx.request(acp.methods.agent.session.load, { sessionId: summary.sessionId, cwd, mcpServers: [] }),
    "session/load",
  );
  await new Promise((resolve) => setTimeout(resolve, 50));
  summary.replayed = [...again.userTexts];
  summary.turns.push(await turn(ctx, again, summary.sessionId, PROMPTS[2]));
});
console.log(JSON.stringify(summary));
