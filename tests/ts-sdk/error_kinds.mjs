// The error catalogue through the official MCP TypeScript SDK: after tools/list, the SDK checks
// every result's structuredContent against the tool's outputSchema, also when isError is true
// (Client.callTool throws on a mismatch). Run by tests/e2e/ts_sdk.rs with
//   SANDGATE_TEST_TS_SDK   the directory scripts/ts-sdk.sh installed the SDK into
//   SANDGATE_MCP_URL       the MCP endpoint
//   SANDGATE_MCP_TOKEN     a token of a tenant without call quotas
//   SANDGATE_MCP_QUOTA_TOKEN  a token of a tenant allowed one call per minute
// Prints "ok (<n> error kinds)" and exits 0, or exits 1 saying what failed.
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';

const sdk = (path) =>
  import(pathToFileURL(join(process.env.SANDGATE_TEST_TS_SDK, 'node_modules/@modelcontextprotocol/sdk/dist/esm', path)).href);
const { Client } = await sdk('client/index.js');
const { StreamableHTTPClientTransport } = await sdk('client/streamableHttp.js');

function check(ok, what) {
  if (!ok) {
    throw new Error(`expected: ${what}`);
  }
}

async function connect(token) {
  const client = new Client({ name: 'sandgate-e2e-ts', version: '0.1.0' });
  const transport = new StreamableHTTPClientTransport(new URL(process.env.SANDGATE_MCP_URL), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
  });
  await client.connect(transport);
  // tools/list: from now on callTool validates structuredContent against each outputSchema.
  const { tools } = await client.listTools();
  check(tools.length === 14, `fourteen tools, not ${tools.length}`);
  for (const tool of tools) {
    check(tool.outputSchema, `${tool.name} declares an outputSchema`);
  }
  return client;
}

const text = (result) => result.content.filter((b) => b.type === 'text').map((b) => b.text).join('\n');

function expectKind(result, kind, retryable, words) {
  check(result.isError === true, `${kind}: isError (got ${JSON.stringify(result)})`);
  check(result.structuredContent?.error === kind, `error ${kind} (got ${JSON.stringify(result.structuredContent)})`);
  check(result.structuredContent.retryable === retryable, `${kind}: retryable ${retryable}`);
  check(text(result).includes(words), `${kind}: the text says ${JSON.stringify(words)} (got ${JSON.stringify(text(result))})`);
}

const client = await connect(process.env.SANDGATE_MCP_TOKEN);
const created = await client.callTool({ name: 'create_sandbox', arguments: {} });
check(!created.isError, `create_sandbox works: ${text(created)}`);
const sandbox = created.structuredContent.sandbox_id;
let kinds = 0;

const missing = 'sbx_00000000000000000000000000000000';
expectKind(
  await client.callTool({ name: 'execute_code', arguments: { sandbox_id: missing, code: '1' } }),
  'not_found', false, `no sandbox ${missing} exists; call create_sandbox to get one`);
kinds++;
expectKind(
  await client.callTool({ name: 'get_file', arguments: { sandbox_id: sandbox, path: '/etc/passwd' } }),
  'bad_path', false, 'files are confined to /home/user');
kinds++;
expectKind(
  await client.callTool({ name: 'run_terminal_command', arguments: { sandbox_id: sandbox, command: 'exit 3' } }),
  'command_failed', false, '[exit code 3]');
kinds++;
expectKind(
  await client.callTool({ name: 'kill_job', arguments: { sandbox_id: sandbox, job_id: 'job-999' } }),
  'no_such_job', false, 'There is no background job "job-999"');
kinds++;
const raised = await client.callTool({ name: 'execute_code', arguments: { sandbox_id: sandbox, code: '1/0' } });
check(raised.isError === true && raised.structuredContent.error.name === 'ZeroDivisionError',
  `a raising cell is an error with its exception (got ${JSON.stringify(raised.structuredContent)})`);
const fine = await client.callTool({ name: 'execute_code', arguments: { sandbox_id: sandbox, code: '6*7' } });
check(!fine.isError && text(fine).includes('42'), `a cell still works: ${text(fine)}`);
await client.callTool({ name: 'close_sandbox', arguments: { sandbox_id: sandbox } });
expectKind(
  await client.callTool({ name: 'list_files', arguments: { sandbox_id: sandbox } }),
  'ended', false, `sandbox ${sandbox} was closed at`);
kinds++;
await client.close();

const limited = await connect(process.env.SANDGATE_MCP_QUOTA_TOKEN);
const first = await limited.callTool({ name: 'create_sandbox', arguments: {} });
check(!first.isError, `the first call is admitted: ${text(first)}`);
const refused = await limited.callTool({ name: 'execute_code', arguments: { code: '1' } });
expectKind(refused, 'quota_exceeded', true, 'limit reached: max_calls_per_minute (1)');
check(refused.structuredContent.limit === 'max_calls_per_minute' && refused.structuredContent.value === 1
  && refused.structuredContent.retry_after_seconds >= 1, `the quota fields stay: ${JSON.stringify(refused.structuredContent)}`);
kinds++;
await limited.close();

console.log(`ok (${kinds} error kinds)`);
