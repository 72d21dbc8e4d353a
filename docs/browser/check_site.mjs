// Open pages of the built docs site in headless Chromium and fail on any console error, page error or failed
// request; a screenshot of each page is written to the output folder.
//   node docs/browser/check_site.mjs http://127.0.0.1:8000/ OUT_DIR "" reference/strategies/
import chromium from "@sparticuz/chromium";
import puppeteer from "puppeteer-core";

const [base, out, ...pages] = process.argv.slice(2);
const browser = await puppeteer.launch({
  args: chromium.args,
  executablePath: await chromium.executablePath(),
  headless: true,
});
let failures = 0;
for (const page of pages) {
  const tab = await browser.newPage();
  const errors = [];
  tab.on("console", (message) => {
    if (message.type() === "error") errors.push(message.text());
  });
  tab.on("pageerror", (error) => errors.push(String(error)));
  tab.on("requestfailed", (request) => errors.push(`request failed: ${request.url()}`));
  const response = await tab.goto(base + page, { waitUntil: "networkidle0" });
  await tab.screenshot({ path: `${out}/${page.replace(/\W+/g, "_") || "index"}.png` });
  const ok = response.ok() && errors.length === 0;
  console.log(`${ok ? "ok" : "FAILED"} /${page} (HTTP ${response.status()})${errors.length ? ": " + errors.join("; ") : ""}`);
  failures += ok ? 0 : 1;
}
await browser.close();
process.exit(failures ? 1 : 0);
