'use strict';
// Resolve `vscode` and `vscode-languageclient/node` to the fakes next to this
// file, so out/extension.js can be loaded by plain Node.
const Module = require('node:module');
const path = require('node:path');

const fakes = {
  vscode: path.join(__dirname, 'fake-vscode.cjs'),
  'vscode-languageclient/node': path.join(__dirname, 'fake-languageclient.cjs'),
};

const original = Module._resolveFilename;
Module._resolveFilename = function (request, ...rest) {
  if (Object.prototype.hasOwnProperty.call(fakes, request)) return fakes[request];
  return original.call(this, request, ...rest);
};

module.exports = { fakes };
