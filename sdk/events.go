package sdk

import (
	"context"
	"net/http"
	"net/url"
	"strconv"

	"github.com/spacesbx/space/api/e2bapi"
)

// EventsOptions page the lifecycle events API: Offset and Limit (E2B's
// default 10, at most 100), oldest first with Asc.
type EventsOptions struct {
	Offset, Limit int
	Asc           bool
}

func (o EventsOptions) query() string {
	q := url.Values{}
	if o.Offset > 0 {
		q.Set("offset", strconv.Itoa(o.Offset))
	}
	if o.Limit > 0 {
		q.Set("limit", strconv.Itoa(o.Limit))
	}
	if o.Asc {
		q.Set("orderAsc", "true")
	}
	if len(q) == 0 {
		return ""
	}
	return "?" + q.Encode()
}

// SandboxEvents lists one sandbox's lifecycle events
// (GET /events/sandboxes/{id}).
func (c *Client) SandboxEvents(ctx context.Context, id string, o EventsOptions) ([]e2bapi.SandboxEvent, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	var out []e2bapi.SandboxEvent
	err := c.rest(ctx, http.MethodGet, "/events/sandboxes/"+url.PathEscape(id)+o.query(), nil, &out, nil)
	return out, err
}

// TeamEvents lists the team's lifecycle events (GET /events/sandboxes).
func (c *Client) TeamEvents(ctx context.Context, o EventsOptions) ([]e2bapi.SandboxEvent, error) {
	var out []e2bapi.SandboxEvent
	err := c.rest(ctx, http.MethodGet, "/events/sandboxes"+o.query(), nil, &out, nil)
	return out, err
}

// CreateWebhook registers a webhook (POST /events/webhooks).
func (c *Client) CreateWebhook(ctx context.Context, w e2bapi.NewWebhook) (e2bapi.Webhook, error) {
	var out e2bapi.Webhook
	err := c.rest(ctx, http.MethodPost, "/events/webhooks", w, &out, nil)
	return out, err
}

// ListWebhooks lists the team's webhooks (GET /events/webhooks).
func (c *Client) ListWebhooks(ctx context.Context) ([]e2bapi.Webhook, error) {
	var out []e2bapi.Webhook
	err := c.rest(ctx, http.MethodGet, "/events/webhooks", nil, &out, nil)
	return out, err
}

// GetWebhook reads one webhook with its delivery state.
func (c *Client) GetWebhook(ctx context.Context, id string) (e2bapi.Webhook, error) {
	var out e2bapi.Webhook
	err := c.rest(ctx, http.MethodGet, "/events/webhooks/"+url.PathEscape(id), nil, &out, nil)
	return out, err
}

// UpdateWebhook changes the fields u sets (PATCH /events/webhooks/{id}).
func (c *Client) UpdateWebhook(ctx context.Context, id string, u e2bapi.WebhookUpdate) (e2bapi.Webhook, error) {
	var out e2bapi.Webhook
	err := c.rest(ctx, http.MethodPatch, "/events/webhooks/"+url.PathEscape(id), u, &out, nil)
	return out, err
}

// DeleteWebhook removes a webhook and its pending deliveries.
func (c *Client) DeleteWebhook(ctx context.Context, id string) error {
	return c.rest(ctx, http.MethodDelete, "/events/webhooks/"+url.PathEscape(id), nil, nil, nil)
}
