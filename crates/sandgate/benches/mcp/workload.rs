//! The workload: a support analyst's conversation (tickets, cells, the conversation itself).

use super::*;

/// 10 000 support tickets as CSV, the same every run.
pub(crate) fn tickets_csv() -> String {
    let regions = ["EMEA", "NA", "LATAM", "APAC"];
    let products = ["billing", "login", "shipping", "returns", "api"];
    let mut rng = StdRng::seed_from_u64(0x5eed_cafe_f00d_d00d);
    let mut csv = String::from("ticket_id,region,product,minutes,csat\n");
    for id in 0..10_000 {
        let region = regions[rng.random_range(0..regions.len())];
        let product = products[rng.random_range(0..products.len())];
        let minutes = rng.random_range(5..605);
        let csat = rng.random_range(1..=5);
        csv.push_str(&format!("{id},{region},{product},{minutes},{csat}\n"));
    }
    csv
}

/// The next `n` bytes of a seeded generator: the same every run, and incompressible.
pub(crate) fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    let mut data = vec![0u8; n];
    rng.fill_bytes(&mut data);
    data
}

pub(crate) const GROUP_BY: &str = "import pandas as pd\n\
df = pd.read_csv('tickets.csv')\n\
summary = df.groupby('region').agg(tickets=('ticket_id', 'count'), mean_minutes=('minutes', 'mean'), csat=('csat', 'mean')).round(2)\n\
summary";

pub(crate) const CHART: &str = "import matplotlib.pyplot as plt\n\
fig, ax = plt.subplots(figsize=(6, 4))\n\
summary['mean_minutes'].plot.bar(ax=ax, color='#4c72b0')\n\
ax.set_title('Mean minutes to resolve, by region')\n\
ax.set_ylabel('minutes')\n\
fig.savefig('chart.png')\n\
plt.show()";

pub(crate) async fn call_ok(
    client: &Client,
    tool: &str,
    args: Value,
) -> Result<mcp_client::ToolResult> {
    let result = client
        .call(tool, args)
        .await
        .map_err(|e| anyhow!("{tool}: protocol error: {e}"))?;
    if result.is_error {
        bail!(
            "{tool}: isError: {}",
            result.text.chars().take(300).collect::<String>()
        );
    }
    Ok(result)
}

/// `execute_code 1+1` in sandbox `id`, `count` times after 10 unmeasured calls, within
/// `budget`; a value other than 2 is an error.
pub(crate) async fn exec_1p1(client: &Client, id: &str, count: usize, budget: &Budget) -> Samples {
    let mut exec = Samples::default();
    for i in 0..count + 10 {
        let mut sink = Samples::default();
        let target = if i < 10 { &mut sink } else { &mut exec };
        let result = target
            .time(
                budget,
                call_ok(
                    client,
                    "execute_code",
                    json!({"sandbox_id": id, "code": "1+1"}),
                ),
            )
            .await;
        if let Some(result) = result
            && result.structured["result"]["text/plain"] != "2"
        {
            exec.fail(format!("1+1 answered {}", result.structured["result"]));
        }
    }
    exec
}

pub(crate) fn sandbox_id(result: &mcp_client::ToolResult) -> Result<String> {
    result.structured["sandbox_id"]
        .as_str()
        .map(str::to_owned)
        .context("no sandbox_id in the result")
}

/// The whole conversation: create, upload, analyse, chart, get the chart, close.
pub(crate) async fn conversation(client: &Client, conversation_id: &str, csv: &str) -> Result<()> {
    let created = call_ok(
        client,
        "create_sandbox",
        json!({"conversation_id": conversation_id}),
    )
    .await?;
    let id = sandbox_id(&created)?;
    call_ok(
        client,
        "upload_file",
        json!({"sandbox_id": id, "path": "tickets.csv", "content_text": csv}),
    )
    .await?;
    let analysed = call_ok(
        client,
        "execute_code",
        json!({"sandbox_id": id, "code": GROUP_BY}),
    )
    .await?;
    if !analysed.text.contains("EMEA") {
        bail!("the group-by did not show the regions: {}", analysed.text);
    }
    let chart = call_ok(
        client,
        "execute_code",
        json!({"sandbox_id": id, "code": CHART}),
    )
    .await?;
    if chart.images.is_empty() {
        bail!("the chart cell returned no image");
    }
    let file = call_ok(
        client,
        "get_file",
        json!({"sandbox_id": id, "path": "chart.png"}),
    )
    .await?;
    if file.images.is_empty() {
        bail!("get_file chart.png returned no image");
    }
    call_ok(client, "close_sandbox", json!({"sandbox_id": id})).await?;
    Ok(())
}
