package dashboard

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// chromiumPath is Debian's chromium (make dashboard-deps installs it).
const chromiumPath = "/usr/bin/chromium"

// browser is one headless chromium with one tab, recording what the page
// asks the network for and what it logs.
type browser struct {
	ctx    context.Context
	origin string

	mu       sync.Mutex
	requests []string
	problems []string // console errors, CSP violations, exceptions
}

func startBrowser(t *testing.T, origin string) *browser {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromiumPath),
		chromedp.Flag("headless", "new"),
		chromedp.WindowSize(1280, 480), // full-page screenshots: the page decides the height
		chromedp.Flag("hide-scrollbars", true),
		chromedp.Flag("force-device-scale-factor", "1"),
	)
	if testenv.IsRoot() {
		// Chromium refuses to run as root with its own (user namespace)
		// sandbox; the test platform runs as root.
		opts = append(opts, chromedp.NoSandbox)
	}
	actx, acancel := chromedp.NewExecAllocator(context.Background(), opts...)
	t.Cleanup(acancel)
	bctx, bcancel := chromedp.NewContext(actx)
	t.Cleanup(bcancel)
	b := &browser{ctx: bctx, origin: origin}
	err := chromedp.Listen(bctx, func(ev any) {
		b.mu.Lock()
		defer b.mu.Unlock()
		switch ev := ev.(type) {
		case *network.EventRequestWillBeSent:
			b.requests = append(b.requests, ev.Request.URL)
		case *log.EventEntryAdded:
			// A refused key (401) and an API this control plane lacks (404)
			// are answers the page shows: not problems.
			if ev.Entry.Level == log.EntryLevelError && !strings.Contains(ev.Entry.Text, "status of 401") && !strings.Contains(ev.Entry.Text, "status of 404") {
				b.problems = append(b.problems, "log: "+ev.Entry.Text+" "+ev.Entry.URL)
			}
		case *runtime.EventExceptionThrown:
			b.problems = append(b.problems, "exception: "+ev.ExceptionDetails.Text)
		case *runtime.EventConsoleAPICalled:
			if ev.Type == runtime.ConsoleAPICalledTypeError {
				var parts []string
				for _, a := range ev.Args {
					parts = append(parts, string(a.Value)+a.Description)
				}
				b.problems = append(b.problems, "console.error: "+strings.Join(parts, " "))
			}
		}
	})
	if err != nil {
		t.Fatalf("starting %s: %v", chromiumPath, err)
	}
	err = chromedp.Do(bctx, chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		if _, err := chromedp.Call(ctx, network.Enable, network.EnableParams{}); err != nil {
			return err
		}
		if _, err := chromedp.Call(ctx, log.Enable, cdp.Empty{}); err != nil {
			return err
		}
		_, err := chromedp.Call(ctx, runtime.Enable, cdp.Empty{})
		return err
	}))
	if err != nil {
		t.Fatalf("starting %s: %v", chromiumPath, err)
	}
	return b
}

// do runs steps, each bounded, failing t with what the page said.
func (b *browser) do(t *testing.T, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatalf("%s: %v\npage problems: %v", what, err, b.report())
	}
}

func (b *browser) report() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.problems...)
}

func (b *browser) eval(t *testing.T, expr string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
	if err != nil {
		t.Fatalf("evaluate %s: %v", expr, err)
	}
	return v
}

// waitJS polls expr in the page until it is true.
func (b *browser) waitJS(t *testing.T, what, expr string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	var last error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](expr))
		cancel()
		if last = err; err == nil && ok {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	body, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
	t.Fatalf("%s: not within %v (last error %v)\npage text:\n%s\npage problems: %v", what, d, last, body, b.report())
}

func (b *browser) screenshot(t *testing.T, name string) {
	t.Helper()
	dir := os.Getenv("SPACE_DASHBOARD_SCREENSHOTS")
	if dir == "" {
		dir = t.TempDir()
	}
	ctx, cancel := context.WithTimeout(b.ctx, 30*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil || len(png) < 1000 {
		t.Fatalf("screenshot %s: %d bytes, %v", name, len(png), err)
	}
	if err := os.WriteFile(filepath.Join(dir, name), png, 0o644); err != nil {
		t.Fatal(err)
	}
}

// waitState polls the API (not the page) until sandbox id is in state.
func waitState(t *testing.T, c *sdk.Client, id, state string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	var got string
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		info, err := c.GetSandbox(ctx, id)
		cancel()
		switch {
		case state == "gone" && errors.Is(err, sdk.ErrNotFound):
			return
		case err == nil:
			got = info.State
			if got == state {
				return
			}
		default:
			got = err.Error()
		}
		time.Sleep(250 * time.Millisecond)
	}
	t.Fatalf("sandbox %s: %q through the API after %v, want %q", id, got, d, state)
}

// chartDrawn: the chart's canvas holds pixels of its series colour (the
// axes and grid alone are grey), and the chart says how many samples.
func chartDrawn(testid string, r, g, b int) string {
	return fmt.Sprintf(`(() => {
	  const fig = document.querySelector('[data-testid=%q]');
	  if (!fig || +fig.dataset.points < 1) return false;
	  const c = fig.querySelector('canvas');
	  if (!c || !c.width || !c.height) return false;
	  const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
	  let n = 0;
	  for (let i = 0; i < px.length; i += 4)
	    if (Math.abs(px[i]-%d) < 40 && Math.abs(px[i+1]-%d) < 40 && Math.abs(px[i+2]-%d) < 40 && px[i+3] > 128) n++;
	  return n > 10;
	})()`, testid, r, g, b)
}

func TestDashboard(t *testing.T) {
	if _, err := exec.LookPath(chromiumPath); err != nil {
		testenv.Skipf(t, "Debian's chromium is not installed at %s (make dashboard-deps installs it): %v", chromiumPath, err)
	}
	p := testenv.StartPlatform(t, testenv.PlatformOptions{Workers: 2})
	c, err := sdk.New(sdk.Config{APIURL: p.APIURL, SandboxURL: p.SandboxURL, APIKey: p.APIKey})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var ids []string
	for i := range 3 {
		sb, err := c.CreateSandbox(ctx, sdk.CreateOptions{Timeout: 10 * time.Minute, Metadata: map[string]string{"n": fmt.Sprint(i)}})
		if err != nil {
			t.Fatalf("create: %v", err)
		}
		ids = append(ids, sb.ID)
		if i == 0 {
			// Something for the charts to show: CPU in bursts, memory
			// held, a file written.
			code, err := sb.Run(ctx, `(for i in $(seq 30); do timeout 2 sh -c 'while :; do :; done'; sleep 2; done) >/dev/null 2>&1 &
				(python3 -c 'import time; b = bytearray(64 << 20); time.sleep(300)') >/dev/null 2>&1 &
				head -c 32M /dev/urandom > /tmp/blob`, sdk.RunOptions{})
			if err != nil || code != 0 {
				t.Fatalf("load in %s: exit %d, %v", sb.ID, code, err)
			}
		}
	}
	busy, idle, paused := ids[0], ids[1], ids[2]
	// One paused through the API, for the list to show (and resume).
	req, _ := http.NewRequestWithContext(ctx, "POST", p.APIURL+"/sandboxes/"+paused+"/pause", nil)
	req.Header.Set("X-API-Key", p.APIKey)
	if res, err := http.DefaultClient.Do(req); err != nil || res.StatusCode != http.StatusNoContent {
		t.Fatalf("pause %s through the API: %v %v", paused, res, err)
	} else {
		res.Body.Close()
	}

	origin := strings.TrimRight(p.APIURL, "/")
	res, err := http.Get(origin + "/dashboard/")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.Contains(res.Header.Get("Content-Security-Policy"), "script-src 'self'") {
		t.Fatalf("GET /dashboard/: %s, CSP %q", res.Status, res.Header.Get("Content-Security-Policy"))
	}
	b := startBrowser(t, origin)
	page := origin + "/dashboard/"

	// A wrong key is refused on the form, and nothing is kept.
	b.do(t, "load", chromedp.Navigate(page), chromedp.WaitVisible(chromedp.ID("secret")))
	b.do(t, "wrong key", chromedp.SendKeys(chromedp.ID("secret"), "e2b_00000000000000000000000000000000deadbeef"),
		chromedp.Click(chromedp.CSS(`button[type=submit]`)))
	b.waitJS(t, "wrong key refused", `(document.querySelector('[data-testid=login-error]')||{}).textContent?.includes('401')`, 15*time.Second)
	kept := b.eval(t, `sessionStorage.length + ':' + document.cookie`)
	if kept != "0:" {
		t.Errorf("after a refused sign-in: sessionStorage length and cookies %q, want nothing kept", kept)
	}

	// The right key: the list shows both sandboxes, running, on a worker.
	b.eval(t, `document.getElementById('secret').value = ''`)
	b.do(t, "sign in", chromedp.SendKeys(chromedp.ID("secret"), p.APIKey),
		chromedp.Click(chromedp.CSS(`button[type=submit]`)))
	for _, id := range ids[:2] {
		b.waitJS(t, "list shows "+id, fmt.Sprintf(`(() => { const r = document.querySelector('tr[data-sandbox-id=%q]');
			return !!r && r.dataset.state === 'running' && /\S/.test(r.children[3].textContent) && r.children[3].textContent !== '—'; })()`, id), 30*time.Second)
	}
	b.waitJS(t, "list shows "+paused+" paused", fmt.Sprintf(`!!document.querySelector('tr[data-sandbox-id=%q][data-state=paused] button[data-action=resume]')`, paused), 30*time.Second)
	where := b.eval(t, `location.href + ' ' + document.cookie + ' ' + sessionStorage.getItem('space.dashboard.credential')`)
	if u, _ := url.Parse(strings.Fields(where)[0]); strings.Contains(u.String(), p.APIKey) {
		t.Errorf("the key is in the URL: %s", u)
	}
	if !strings.Contains(where, p.APIKey) || strings.Count(where, p.APIKey) != 1 {
		t.Errorf("the key is not (only) in sessionStorage: %q", where)
	}
	b.screenshot(t, "dashboard-list.png")

	// The busy sandbox's page: charts drawn from the metrics API.
	b.do(t, "open "+busy, chromedp.Click(chromedp.CSS(fmt.Sprintf(`tr[data-sandbox-id=%q] a`, busy))))
	b.waitJS(t, "detail of "+busy, `!!document.querySelector('[data-testid=detail][data-state=running]')`, 15*time.Second)
	b.waitJS(t, "CPU chart drawn", chartDrawn("chart-cpu", 0x2f, 0x6f, 0xde), 30*time.Second)
	b.waitJS(t, "memory chart drawn", chartDrawn("chart-mem", 0x1b, 0x9e, 0x5a), 30*time.Second)
	b.waitJS(t, "logs panel answered", `!!document.querySelector('[data-testid=no-logs-api],[data-testid=logs],[data-testid=logs-empty]')`, 15*time.Second)
	// A few more polls, so the screenshot shows a series.
	b.waitJS(t, "three samples", `+document.querySelector('[data-testid=chart-cpu]').dataset.points >= 3`, 40*time.Second)
	b.screenshot(t, "dashboard-sandbox.png")

	// Pause and resume from the page, checked through the API.
	b.do(t, "pause", chromedp.Click(chromedp.CSS(`.detail button[data-action=pause]`)))
	waitState(t, c, busy, "paused", 60*time.Second)
	b.waitJS(t, "page shows paused", `!!document.querySelector('[data-testid=detail][data-state=paused] button[data-action=resume]')`, 15*time.Second)
	b.do(t, "resume", chromedp.Click(chromedp.CSS(`.detail button[data-action=resume]`)))
	waitState(t, c, busy, "running", 60*time.Second)
	b.waitJS(t, "page shows running", `!!document.querySelector('[data-testid=detail][data-state=running] button[data-action=pause]')`, 15*time.Second)

	// Kill from the list (asked twice), checked through the API.
	b.do(t, "back to the list", chromedp.Navigate(page+"#/sandboxes"))
	row := fmt.Sprintf(`tr[data-sandbox-id=%q]`, idle)
	b.do(t, "kill", chromedp.WaitVisible(chromedp.CSS(row+` button[data-action=kill]`)),
		chromedp.Click(chromedp.CSS(row+` button[data-action=kill]`)),
		chromedp.Click(chromedp.CSS(row+` button[data-action=kill-confirm]`)))
	waitState(t, c, idle, "gone", 60*time.Second)
	b.waitJS(t, "list drops the killed sandbox", fmt.Sprintf(`!document.querySelector(%q)`, row), 15*time.Second)
	// Resume from the list, too.
	prow := fmt.Sprintf(`tr[data-sandbox-id=%q]`, paused)
	b.do(t, "resume from the list", chromedp.Click(chromedp.CSS(prow+` button[data-action=resume]`)))
	waitState(t, c, paused, "running", 60*time.Second)
	b.waitJS(t, "list shows "+paused+" running", fmt.Sprintf(`!!document.querySelector(%q)`, prow+`[data-state=running]`), 15*time.Second)

	// Templates and keys pages answer (keys: "no API" until there is one).
	b.do(t, "templates", chromedp.Navigate(page+"#/templates"))
	b.waitJS(t, "templates listed", `!!document.querySelector('[data-testid=templates] tbody tr')`, 15*time.Second)
	b.do(t, "keys", chromedp.Navigate(page+"#/keys"))
	b.waitJS(t, "keys page answered", `!!document.querySelector('[data-testid=keys],[data-testid=no-keys-api]')`, 15*time.Second)

	// The CSP is in force and this test sees its violations: an inline
	// style added now is refused, and reported.
	before := len(b.report())
	b.eval(t, `(document.head.appendChild(Object.assign(document.createElement('style'), {textContent: 'body{color:red}'})), getComputedStyle(document.body).color)`)
	b.waitJS(t, "inline style refused", `getComputedStyle(document.body).color !== 'rgb(255, 0, 0)'`, 5*time.Second)
	deadline := time.Now().Add(10 * time.Second)
	for len(b.report()) == before && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.problems) == before || !strings.Contains(strings.Join(b.problems[before:], "\n"), "Content Security Policy") {
		t.Errorf("an inline style was not reported as a CSP violation: %v", b.problems[before:])
	}
	b.problems = b.problems[:before]

	// Everything the page fetched came from its own origin, and nothing
	// went wrong in it (CSP violations are console errors).
	if len(b.requests) == 0 {
		t.Error("no requests recorded")
	}
	for _, r := range b.requests {
		if !strings.HasPrefix(r, origin+"/") {
			t.Errorf("request outside the page's origin %s: %s", origin, r)
		}
	}
	for _, pr := range b.problems {
		t.Errorf("page: %s", pr)
	}
}
