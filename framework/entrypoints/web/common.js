// Shared by the pages: the API key (kept in this tab's sessionStorage only) and fetch with it.
"use strict";

const KEY_STORAGE = "tokenmill.apiKey";

class AuthError extends Error {}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

// fetch(path) with "Authorization: Bearer <key>" when a key is set. A 401 shows the key form
// (where the page has one) and throws AuthError.
async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = apiKey();
  if (key) headers.set("Authorization", "Bearer " + key);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) {
    askForKey(key ? "The key was refused; enter the server's API key." : "");
    throw new AuthError("this server needs an API key");
  }
  return response;
}

function askForKey(message) {
  const form = document.getElementById("key-form");
  if (!form) return;
  form.hidden = false;
  const input = document.getElementById("api-key");
  input.value = "";
  input.placeholder = message || "the server's --api-key";
  input.focus();
}

// The key form: store the key for this tab, hide the form, and tell the page.
function onKeyForm(callback) {
  const form = document.getElementById("key-form");
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, document.getElementById("api-key").value.trim());
    form.hidden = true;
    callback();
  });
}

// The message of an OpenAI-form error response, or its status line.
async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) {
    // not JSON
  }
  return `HTTP ${response.status} ${response.statusText}`;
}

function formatNumber(value, digits = 1) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "–";
  return value.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: 0 });
}

function formatSeconds(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  return seconds < 1 ? `${formatNumber(seconds * 1000, 0)} ms` : `${formatNumber(seconds, 2)} s`;
}
