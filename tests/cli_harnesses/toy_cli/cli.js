#!/usr/bin/env node
// toy-cli: a small agent CLI, the kind harnesses/REAL_HARNESSES.md "Adding a CLI" wraps. It is what the
// walkthrough test installs as if from npm: it reads its config file (providers, and models keyed by
// "provider/model"), takes the model as provider/model, calls the provider's Chat Completions endpoint
// with one shell tool, runs the command the model asks for, and sends the result back until the model
// answers in text. Usage: toy-cli run --config FILE --model PROVIDER/MODEL [--brief] -- PROMPT
"use strict";
const fs = require("fs");
const { execSync } = require("child_process");

function die(msg) {
  process.stderr.write(`toy-cli: ${msg}\n`);
  process.exit(2);
}

function parseArgs(argv) {
  const opts = { brief: false };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--") { opts.prompt = argv.slice(i + 1).join(" "); break; }
    if (a === "--config") opts.config = argv[++i];
    else if (a === "--model") opts.model = argv[++i];
    else if (a === "--brief") opts.brief = true;
    else if (a !== "run") die(`unknown argument ${a}`);
  }
  if (!opts.config || !opts.model || !opts.prompt) die("usage: toy-cli run --config FILE --model P/M -- PROMPT");
  return opts;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const config = JSON.parse(fs.readFileSync(opts.config, "utf8"));
  const slash = opts.model.indexOf("/");
  if (slash < 0) die(`--model ${opts.model}: expected provider/model`);
  const provider = config.providers[opts.model.slice(0, slash)];
  const settings = config.models[opts.model];
  if (!provider) die(`no provider ${opts.model.slice(0, slash)} in ${opts.config}`);
  if (!settings) die(`model ${opts.model} is not configured; configured: ${Object.keys(config.models)}`);
  const system = opts.brief
    ? "You are toy-cli. Use do_it to run commands."
    : "You are toy-cli, a careful coding agent. Inspect the working directory with do_it, change what the " +
      "task asks, check the result, then answer with one line. (full mode)";
  const tools = [{
    type: "function",
    function: {
      name: "do_it",
      description: "Runs one line in /bin/sh in the working directory; returns its output.",
      parameters: { type: "object", properties: { script: { type: "string" } }, required: ["script"] },
    },
  }];
  const messages = [{ role: "system", content: system }, { role: "user", content: opts.prompt }];
  for (let turn = 0; turn < settings.maxTurns; turn++) {
    const res = await fetch(`${provider.baseUrl}/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", authorization: `Bearer ${process.env[provider.apiKeyEnv]}` },
      body: JSON.stringify({ model: opts.model.slice(slash + 1), messages, tools, max_tokens: settings.maxTokens }),
    });
    if (!res.ok) die(`HTTP ${res.status}: ${await res.text()}`);
    const msg = (await res.json()).choices[0].message;
    messages.push(msg);
    if (!msg.tool_calls || !msg.tool_calls.length) {
      process.stdout.write(JSON.stringify({ final: msg.content, turns: turn + 1 }) + "\n");
      return;
    }
    for (const call of msg.tool_calls) {
      let out;
      try {
        out = execSync(JSON.parse(call.function.arguments).script, { shell: "/bin/sh", encoding: "utf8" });
      } catch (err) {
        out = `error: ${err.message}`;
      }
      messages.push({ role: "tool", tool_call_id: call.id, content: out });
    }
  }
  die(`no answer after ${settings.maxTurns} turns`);
}

main().catch((err) => die(err.stack || String(err)));
