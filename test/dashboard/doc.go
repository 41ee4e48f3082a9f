// Package dashboard drives the control plane's web dashboard
// (internal/dashboard, served at /dashboard/) in Debian's headless
// chromium against a real `space up`: sign-in (a wrong key refused), the
// sandbox list, a metrics chart drawn, pause, resume and kill from the
// page, each checked through the API; and no request leaves the page's
// origin, no CSP violation. SPACE_DASHBOARD_SCREENSHOTS=<dir> keeps its
// screenshots (docs/img holds the committed ones).
package dashboard
